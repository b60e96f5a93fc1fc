"""The decoding loop: the engine's rounds (draft, verify, commit), a generation's settings and output, the tree
round, the prompt cache kept between generations, and the statistics a generation reports."""
