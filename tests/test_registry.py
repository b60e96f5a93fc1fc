"""The methods registry (speculant/methods/registry.py) is the one list of methods: the command line,
the server, method specs and the engine read it, and every method's drafter is built through it."""

import argparse

import pytest

from speculant.cli_options import add_model_args
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.errors import SpeculantError
from speculant.methods.config import HEAD_METHODS, METHODS, MODEL_METHODS, MethodConfig, parse_method
from speculant.methods.base import Drafter
from speculant.methods.registry import METHOD_SPECS
from speculant.server.app import offered_methods

from conftest import tiny_model


def test_every_list_of_methods_is_the_registry():
    assert METHODS == tuple(METHOD_SPECS) and METHODS[0] == "ar"
    assert set(HEAD_METHODS) == {n for n, s in METHOD_SPECS.items() if s.loads == "heads"} >= {"medusa", "eagle2", "eagle3"}
    assert set(MODEL_METHODS) == {"draft", "hybrid", "draft_tree"}
    p = argparse.ArgumentParser()
    add_model_args(p)
    assert tuple(next(a for a in p._actions if a.dest == "method").choices) == METHODS
    for name in METHODS:
        assert p.parse_args(["--method", name]).method == name
    with pytest.raises(SpeculantError, match="choose one of " + ", ".join(METHODS)):
        MethodConfig("nope")


def test_a_spec_decides_which_options_a_method_takes():
    assert parse_method("eagle3:nodes=12").heads.nodes == 12
    with pytest.raises(SpeculantError, match="bad method option 'ngram=3'"):
        parse_method("eagle3:ngram=3")
    assert parse_method("lookup:ngram=3").lookup.max_ngram == 3
    with pytest.raises(SpeculantError, match="bad method option 'topk=3'"):
        parse_method("lookup:topk=3")


@pytest.mark.parametrize("name", [n for n, s in METHOD_SPECS.items() if s.loads != "heads"])
def test_the_engine_builds_each_method_through_its_spec(name):
    target = tiny_model(16, seed=1)
    draft = tiny_model(16, seed=2) if METHOD_SPECS[name].loads == "draft" else None
    spec = METHOD_SPECS[name]
    if name == "mtp":  # a llama-style tiny model ships no MTP layer (tests/test_qwen35_mtp.py runs one that does)
        with pytest.raises(SpeculantError, match="--method mtp cannot run on this model: the model ships no multi"):
            Engine(target, draft, MethodConfig(name))
        return
    engine = Engine(target, draft, MethodConfig(name))
    drafter = engine._drafter(None, 64, None)
    if spec.build is None:
        assert drafter is None
        return
    assert isinstance(drafter, Drafter) and drafter.name == name
    assert (drafter.nodes is not None) == spec.tree  # trees fix their node count, chains follow the policy
    done = engine.generate([1, 2, 3, 1, 2], GenerationConfig(max_new_tokens=12, ignore_eos=True))
    assert done.stats.method == name and len(done.token_ids) == 12


def test_a_method_that_needs_a_draft_model_says_so_and_the_server_offers_only_what_it_can_run():
    target = tiny_model(16, seed=1)
    for name in MODEL_METHODS:
        with pytest.raises(SpeculantError, match=f"--method {name} needs a draft model"):
            Engine(target, None, MethodConfig(name))
    offered = offered_methods(Engine(target, None, MethodConfig("lookup")))
    assert offered == [n for n, s in METHOD_SPECS.items() if s.loads == "" and s.why_not(target.model) is None]
    assert "lookup_tree" in offered and "mtp" not in offered  # no MTP layer in a llama-style model


def test_a_spec_that_loads_heads_says_how():
    from speculant.methods.base import MethodSpec

    with pytest.raises(ValueError, match="method x"):
        MethodSpec("x", "loads heads without a loader", build=None, loads="heads")
    with pytest.raises(ValueError, match="method y"):
        MethodSpec("y", "unknown option set", build=None, options="trees")
    for name in HEAD_METHODS:
        assert METHOD_SPECS[name].load is not None
