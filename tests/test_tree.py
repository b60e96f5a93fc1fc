"""DraftTree: shape checks, masks, positions and per-row paths."""

import pytest
import torch

from speculant.errors import SpeculantError
from speculant.exact.tree import DraftTree, as_tree
from speculant.methods.base import Draft


def test_tree_structure_masks_positions_and_paths():
    t = DraftTree(torch.tensor([5, 6, 7, 8]), [-1, -1, 0, 2])
    assert t.depth == [1, 1, 2, 3] and t.children == [[0, 1], [2], [], [3], []]
    assert t.path(3) == [0, 2, 3] and t.path(1) == [1] and t.max_depth == 3 and not t.is_chain()
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]])
    assert torch.equal(t.ancestor_mask().int(), expect)
    assert t.positions(10).tolist() == [10, 11, 11, 12, 13]
    assert t.row_paths(t.tokens.tolist()) == [[], [5], [6], [5, 7], [5, 7, 8]]


def test_chain_is_a_tree():
    c = as_tree(Draft(torch.tensor([3, 1, 2]), None))
    assert c.parents == [-1, 0, 1] and c.is_chain() and c.depth == [1, 2, 3]
    assert torch.equal(c.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    e = DraftTree.chain(torch.zeros(0, dtype=torch.long))
    assert e.size == 0 and e.max_depth == 0 and e.ancestor_mask().shape == (1, 1)


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-2]])
def test_bad_parents_are_clear_errors(parents):
    with pytest.raises(SpeculantError, match="parent"):
        DraftTree(torch.zeros(len(parents), dtype=torch.long), parents)
    with pytest.raises(SpeculantError, match="one parent per token"):
        DraftTree(torch.zeros(3, dtype=torch.long), [-1])
