"""Tree verification: greedy unit cases, and exact distributions (chi-square over every outcome) for
siblings drawn i.i.d., without replacement and deterministically (top-b), with a control that a
wrong q is caught."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from speculant.exact.distributions import Dist
from speculant.exact.tree import DraftTree
from speculant.exact.verify_tree import verify_tree_greedy, verify_tree_sampled

V = 3


def one_hot_logits(tops: list[int], vocab: int = 8) -> torch.Tensor:
    x = torch.zeros(len(tops), vocab)
    x[torch.arange(len(tops)), torch.tensor(tops)] = 5.0
    return x


def test_greedy_picks_the_longest_accepted_path():
    # pending -> {0: 3, 1: 4}; 0 -> {2: 5, 3: 6}; 3 -> {4: 7}
    tree = DraftTree(torch.tensor([3, 4, 5, 6, 7]), [-1, -1, 0, 0, 3])
    # the target's top token after: pending 3, node0 6, node1 -, node2 -, node3 7, node4 1
    v = verify_tree_greedy(tree, one_hot_logits([3, 6, 0, 0, 7, 1]))
    n = int(v.n)
    assert n == 3 and v.nodes[:n].tolist() == [0, 3, 4] and v.tokens[: n + 1].tolist() == [3, 6, 7, 1]
    v = verify_tree_greedy(tree, one_hot_logits([4, 6, 2, 0, 7, 1]))  # only node 1 right: then its row
    assert int(v.n) == 1 and v.nodes[:1].tolist() == [1] and v.tokens[:2].tolist() == [4, 2]
    v = verify_tree_greedy(tree, one_hot_logits([0, 6, 2, 0, 7, 1]))  # nothing right
    assert int(v.n) == 0 and v.tokens[:1].tolist() == [0]
    empty = DraftTree(torch.zeros(0, dtype=torch.long), [])
    v = verify_tree_greedy(empty, one_hot_logits([5]))
    assert int(v.n) == 0 and v.tokens.tolist() == [5]


def test_greedy_on_a_chain_equals_the_chain_rule():
    from speculant.exact.verify_chain import verify_greedy

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        k = int(torch.randint(0, 6, (1,), generator=g))
        draft = torch.randint(0, 3, (k,), generator=g)
        logits = torch.randn(k + 1, 3, generator=g)
        tokens, n = verify_greedy(draft, logits)
        v = verify_tree_greedy(DraftTree.chain(draft), logits)
        assert int(v.n) == int(n) and v.tokens[: int(n) + 1].tolist() == tokens[: int(n) + 1].tolist()


class Toy:
    """A 'model' over V tokens: a fixed random distribution per prefix (sharpness s)."""

    def __init__(self, seed: int, s: float) -> None:
        self.seed, self.s, self.memo = seed, s, {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.memo:
            g = torch.Generator().manual_seed(hash((self.seed, prefix)) % 2**31)
            self.memo[prefix] = (torch.randn(V, generator=g) * self.s).softmax(-1)
        return self.memo[prefix]


def draft_tree(draft: Toy, widths: list[int], mode: str, g: torch.Generator, wrong_q: bool = False):
    """A tree with widths[d] children under every node at depth d; siblings drawn by `mode`."""
    tokens, parents, qs, prefixes = [], [], [], {-1: ()}
    frontier = [-1]
    for width in widths:
        nxt = []
        for par in frontier:
            r = draft(prefixes[par])
            left = r.clone()
            for j in range(width):
                if mode == "iid":
                    q = r
                elif mode == "without":
                    if left.sum() <= 0:
                        break
                    q = r if wrong_q else left / left.sum()
                else:  # top-b: deterministic
                    q = None
                if mode == "topb":
                    x = int(r.argsort(descending=True, stable=True)[j])
                else:
                    x = int(torch.multinomial(left if mode == "without" else r, 1, generator=g))
                    left[x] = 0.0
                tokens.append(x)
                parents.append(par)
                qs.append(q)
                prefixes[len(tokens) - 1] = prefixes[par] + (x,)
                nxt.append(len(tokens) - 1)
        frontier = nxt
    q = None if mode == "topb" else Dist(torch.arange(V).expand(len(qs), V), torch.stack(qs), V)
    return DraftTree(torch.tensor(tokens), parents, q), prefixes


def run(target: Toy, draft: Toy, widths: list[int], mode: str, trials: int, seed: int, wrong_q: bool = False):
    L = len(widths) + 1
    g = torch.Generator().manual_seed(seed)
    counts = {}
    for _ in range(trials):
        tree, prefixes = draft_tree(draft, widths, mode, g, wrong_q)
        rows = [target(())] + [target(prefixes[i]) for i in range(tree.size)]
        p = Dist(torch.arange(V).expand(len(rows), V), torch.stack(rows), V)
        v = verify_tree_sampled(tree, p, g)
        n = int(v.n)
        out = tuple(v.tokens[: n + 1].tolist())
        assert v.nodes[:n].tolist() == tree.path(int(v.nodes[n - 1]))[:n] if n else True
        while len(out) < L:  # the rest by plain sampling, to compare whole sequences
            out += (int(torch.multinomial(target(out), 1, generator=g)),)
        counts[out] = counts.get(out, 0) + 1
    seqs = list(itertools.product(range(V), repeat=L))
    exp = []
    for s in seqs:
        pr = 1.0
        for i in range(L):
            pr *= float(target(s[:i])[s[i]])
        exp.append(pr * trials)
    return chisquare([counts.get(s, 0) for s in seqs], exp).pvalue


@pytest.mark.parametrize("mode,widths", [("iid", [3, 2]), ("without", [2, 2]), ("topb", [2, 2]), ("without", [3, 1])])
def test_sampled_tree_output_has_the_targets_distribution(mode, widths):
    target, draft = Toy(1, 1.5), Toy(2, 1.5)
    assert run(target, draft, widths, mode, 4000, seed=7) > 1e-3


def test_a_wrong_q_for_siblings_drawn_without_replacement_is_caught():
    # q = the draft's distribution for every sibling (right for i.i.d. draws, wrong here): the test must see it
    target, draft = Toy(3, 2.0), Toy(4, 2.0)
    assert run(target, draft, [2, 1], "without", 4000, seed=8, wrong_q=True) < 1e-6
