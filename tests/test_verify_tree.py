"""Tree verification: greedy unit cases, and exact output distributions (every way a round's path can be
drawn and accepted, enumerated) for siblings drawn i.i.d., without replacement and deterministically (top-b),
with a control that a wrong q is caught, and a chi-square run of the real sampling path."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from speculant.exact.distributions import Dist
from speculant.exact.tree import DraftTree
from speculant.exact.verify_tree import (
    tree_acceptance,
    verify_tree_greedy,
    verify_tree_sampled,
)

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


def _siblings(r: torch.Tensor, width: int, mode: str, wrong_q: bool):
    """Every way draft_tree draws `width` siblings from r: (tokens, their q rows (None: one-hot), probability)."""
    if mode == "topb":
        yield [int(x) for x in r.argsort(descending=True, stable=True)[:width]], [None] * width, 1.0
        return

    def more(left, tokens, qs, pr):
        if len(tokens) == width:
            yield tokens, qs, pr
            return
        drawn = r if mode == "iid" else left / left.sum()
        for x in range(V):
            if float(drawn[x]) > 0:
                rest = left.clone()
                rest[x] = 0.0
                q = r if mode == "iid" or wrong_q else drawn
                yield from more(rest, tokens + [x], qs + [q], pr * float(drawn[x]))

    yield from more(r.clone(), [], [], 1.0)


def _paths(target: Toy, draft: Toy, widths: list[int], mode: str, wrong_q: bool, d: int = 0, prefix=(), pr=1.0):
    """Every way a round can go along its path, with its probability: the siblings drawn at each row of the
    path, and which of them is accepted (None: all rejected). Acceptance probabilities come from the rule as
    the module docstring states it, computed here: min(1, p'(x_j) / q_j(x_j)), p' = p, then the normalized
    residual max(0, p' - q_j) after each rejection. Yields ([(tokens, qs, accepted, ratios)], probability)."""
    for tokens, qs, p_sib in _siblings(draft(prefix), widths[d], mode, wrong_q):
        p_res, stay, ratios = target(prefix).double(), p_sib, []
        for j, (x, q) in enumerate(zip(tokens, qs)):
            q = torch.nn.functional.one_hot(torch.tensor(x), V).double() if q is None else q.double()
            ratios.append(float(p_res[x] / q[x]))
            a = min(1.0, ratios[-1])
            if a > 0:
                level = [(tokens, qs, j, list(ratios))]
                if d + 1 < len(widths):
                    for rest, w in _paths(target, draft, widths, mode, wrong_q, d + 1, prefix + (x,), pr * stay * a):
                        yield level + rest, w
                else:
                    yield level, pr * stay * a
            stay *= 1.0 - a
            if stay == 0.0:
                break
            p_res = (p_res - q).clamp(min=0.0)
            p_res = p_res / p_res.sum()
        if stay > 0.0:
            yield [(tokens, qs, None, ratios)], pr * stay


def _tree_for(target: Toy, draft: Toy, widths: list[int], mode: str, wrong_q: bool, levels):
    """draft_tree's tree with the path's rows drawn as `levels` says and every other row's siblings fixed (the
    first way they can be drawn; rows off the path do not change the outcome). -> (tree, p, path nodes, prefixes)."""
    tokens, parents, qs, prefixes, path = [], [], [], {-1: ()}, [-1]
    frontier = [-1]
    for d, width in enumerate(widths):
        nxt = []
        on_path = d < len(levels) and len(path) == d + 1
        for par in frontier:
            if on_path and par == path[-1]:
                sib, sib_q, accepted = levels[d][0], levels[d][1], levels[d][2]
            else:
                (sib, sib_q, _), accepted = next(_siblings(draft(prefixes[par]), width, mode, wrong_q)), None
            for j, (x, q) in enumerate(zip(sib, sib_q)):
                tokens.append(x)
                parents.append(par)
                qs.append(q)
                prefixes[len(tokens) - 1] = prefixes[par] + (x,)
                nxt.append(len(tokens) - 1)
                if accepted == j:
                    path.append(len(tokens) - 1)
        frontier = nxt
    q = None if mode == "topb" else Dist(torch.arange(V).expand(len(qs), V), torch.stack(qs), V)
    tree = DraftTree(torch.tensor(tokens), parents, q)
    rows = [target(())] + [target(prefixes[i]) for i in range(tree.size)]
    return tree, Dist(torch.arange(V).expand(len(rows), V), torch.stack(rows), V), path[1:], prefixes


def _forcing(path_rows: dict):
    """tree_acceptance's `uniform` for one path: {slot of a path row: its level from _paths}; the j-th call
    rejects (just above the ratio) or accepts (just below) child j of each path row, 0 elsewhere."""
    calls = itertools.count()

    def uniform(size: int) -> torch.Tensor:
        j, u = next(calls), torch.zeros(size)
        for slot, (_, _, accepted, ratios) in path_rows.items():
            if j >= len(ratios):  # past the row's children (or the accepted one): left at 0
                continue
            if accepted is None or j < accepted:
                u[slot] = ratios[j] * (1 + 1e-6)
                assert u[slot] < 1.0  # a rejection this close to ratio 1 would need a finer margin
            elif j == accepted:
                u[slot] = min(1.0, ratios[j]) * (1 - 1e-6)
        return u

    return uniform


def exact_deviation(target: Toy, draft: Toy, widths: list[int], mode: str, wrong_q: bool = False) -> float:
    """The largest gap between the probability of each whole output sequence (len(widths) + 1 tokens: the
    round's tokens, then plain sampling from the target) and the target's own, computed exactly: over every
    way the path's siblings can be drawn and every accepted sibling, tree_acceptance is driven with uniforms
    just below the acceptance threshold where a sibling is accepted and just above where it is rejected (0 on
    rows off the path). It must follow exactly that path, and its last token follows its final row."""
    L = len(widths) + 1
    out, total = {}, 0.0
    for levels, w in _paths(target, draft, widths, mode, wrong_q):
        total += w
        tree, p, path, prefixes = _tree_for(target, draft, widths, mode, wrong_q, levels)
        rows = [r for r in range(tree.size + 1) if tree.children[r]]
        path_rows = {rows.index(0 if d == 0 else path[d - 1] + 1): level for d, level in enumerate(levels)}
        node, n, final = tree_acceptance(tree, p, _forcing(path_rows))
        assert int(n) == len(path) and int(node) == (path[-1] if path else -1), (levels, int(n), int(node), path)
        head = prefixes[path[-1]] if path else ()
        last = final.dense()[0].double()
        assert last.min() >= 0 and last.sum() > 0
        for y in range(V):
            for tail in itertools.product(range(V), repeat=L - len(head) - 1):
                seq, pr = head + (y,) + tail, w * float(last[y] / last.sum())
                for i in range(len(head) + 1, L):
                    pr *= float(target(seq[:i])[seq[i]])
                out[seq] = out.get(seq, 0.0) + pr
    assert abs(total - 1.0) < 1e-6, total
    gap = 0.0
    for seq in itertools.product(range(V), repeat=L):
        want = 1.0
        for i in range(L):
            want *= float(target(seq[:i])[seq[i]])
        gap = max(gap, abs(out.get(seq, 0.0) - want))
    return gap


@pytest.mark.parametrize("mode,widths", [("iid", [3, 2]), ("without", [2, 2]), ("topb", [2, 2]), ("without", [3, 1])])
def test_sampled_tree_output_has_the_targets_distribution_exactly(mode, widths):
    """Float32 rows leave ~1e-7; the wrong q below is off by far more."""
    assert exact_deviation(Toy(1, 1.5), Toy(2, 1.5), widths, mode) < 1e-6


def test_a_wrong_q_for_siblings_drawn_without_replacement_is_caught():
    # q = the draft's distribution for every sibling (right for i.i.d. draws, wrong here): the check must see it
    target, draft = Toy(3, 2.0), Toy(4, 2.0)
    assert exact_deviation(target, draft, [2, 2], "without", wrong_q=True) > 1e-3
    assert exact_deviation(target, draft, [2, 2], "without") < 1e-6


def test_sampled_tree_output_end_to_end():
    """The generator path (uniforms, the draw, the verdict's tokens and nodes) by chi-square over every whole
    output: 2000 rounds of verify_tree_sampled itself; the exact tests above cover the settings."""
    target, draft = Toy(1, 1.5), Toy(2, 1.5)
    assert run(target, draft, [2, 2], "without", 2000, seed=7) > 1e-3
