"""Training draft heads on the CPU (`speculant train-heads`, `speculant export-heads`): the target's own
answers, the text, the tapped features, the objectives and the loop. The heads themselves, and what a
head method loads at run time, live in speculant/heads; nothing there imports this package."""
