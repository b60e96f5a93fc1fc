"""`--method mtp` on a tiny Qwen3.5 with an MTP layer (`mtp.*` added to transformers' safetensors): greedy identity
with `ar`, the MTP cache after many partly accepted rounds equal to a fresh pass over the committed rows, and the
sampled output's distribution (chi-square per position and joint, with a negative control)."""

import pytest
import torch

from qwen35_tiny import prompt, save_qwen35
from sampled import biased_acceptance, exact_joint, exact_paths, sample_runs
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.errors import SpeculantError
from speculant.methods.config import MethodConfig, parse_method
from speculant.methods.mtp import MTPDrafter
from speculant.models import load_model
from speculant.models.transformer import FINAL_HIDDEN
from speculant.exact.sampler import Sampler, SamplingConfig

V = 4
PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
CHECKED, JOINT, GENERATED = 3, 2, 6
RUNS, CONTROL_RUNS = 400, 150  # 400: every cell of the checked positions expects > 5 draws
ALL = SamplingConfig(0.9, top_k=3, top_p=0.95, min_p=0.05, repeat_penalty=1.3, repeat_last_n=3, presence_penalty=0.4,
                     frequency_penalty=0.3, logit_bias={2: 0.5, 0: -0.3})


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return load_model(str(save_qwen35(tmp_path_factory.mktemp("q35mtp") / "tiny")), progress=False, use_cache=False)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Vocabulary 4 and flat logits: drafts are accepted and rejected by chance."""
    folder = save_qwen35(tmp_path_factory.mktemp("q35mtp4") / "tiny", vocab_size=V)
    return load_model(str(folder), progress=False, use_cache=False)


def test_greedy_mtp_is_ar(big, small):
    for target, ids in ((big, prompt(30) + prompt(10, 2) * 3), (small, PROMPT * 3)):
        gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
        want = Engine(target).generate(ids, gen).token_ids
        done = Engine(target, method=MethodConfig("mtp")).generate(ids, gen)
        assert done.token_ids == want
        assert done.stats.drafted_tokens > 0
    assert done.stats.accepted_tokens > 0  # the 4-token model accepts some


def test_mtp_cache_after_rounds_is_a_fresh_pass(small):
    """The drafter's MTP cache after a generation (rounds partly accepted, draft rows rolled back) holds exactly
    the committed rows: equal to one MTP pass over (t_p, h_{p-1}) of the whole context (float tolerance: the
    fresh pass is one long pass, the drafter's were short ones). The rows past `fed` are the last round's drafts
    (built from the MTP's own hidden state), dropped at the next round: a fixed draft length of 3 makes sure
    there are some, so the comparison must stop at `fed` whatever the governor would have chosen."""
    model = small.model
    made: list[MTPDrafter] = []
    orig = MTPDrafter.__init__

    def keep(self, *a, **kw):
        orig(self, *a, **kw)
        made.append(self)

    eng = Engine(small, method=parse_method("mtp:k=3,schedule=fixed"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MTPDrafter, "__init__", keep)
        done = eng.generate(PROMPT, GenerationConfig(max_new_tokens=30, ignore_eos=True))
    d = made[0]
    assert done.stats.rounds > 3 and 0 < done.stats.accepted_tokens < done.stats.drafted_tokens
    ctx = PROMPT + done.token_ids[:-1]
    n = d.fed
    assert n >= len(PROMPT) and d.cache.length > n  # the last round's draft rows are still there, past fed
    h = model(torch.tensor(ctx), model.new_cache(len(ctx)), taps=(FINAL_HIDDEN,)).taps[FINAL_HIDDEN]
    fresh = model.mtp.new_cache(model, len(ctx))
    model.mtp(model, torch.tensor(ctx[:n]), torch.cat([torch.zeros_like(h[:1]), h[: n - 1]]), fresh)
    assert torch.allclose(d.cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5)
    assert torch.allclose(d.cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5)


def test_mtp_needs_an_mtp_layer(tmp_path):
    target = load_model(str(save_qwen35(tmp_path / "nomtp", mtp=False)), progress=False, use_cache=False)
    assert target.model.mtp is None
    with pytest.raises(SpeculantError, match="multi-token-prediction"):
        MTPDrafter(target.model, Sampler(SamplingConfig(), 128), 64)


def test_sampled_mtp_has_the_target_distribution(small):
    levels = exact_paths(small, PROMPT, ALL, CHECKED)
    exp = torch.stack([sum(w * p for _, w, p in level) for level in levels])
    joint = exact_joint(levels, JOINT)
    eng = Engine(small, method=MethodConfig("mtp"))
    runs = sample_runs(lambda i: eng, PROMPT, ALL, CHECKED, V, RUNS, generate=GENERATED, joint=JOINT)
    assert 0 < runs.accepted < runs.drafted
    assert min(runs.pvalues(exp)) > 1e-3
    assert runs.joint_pvalue(joint) > 1e-3


def test_sampled_mtp_negative_control(small, monkeypatch):
    biased_acceptance(monkeypatch)
    levels = exact_paths(small, PROMPT, ALL, CHECKED)
    exp = torch.stack([sum(w * p for _, w, p in level) for level in levels])
    eng = Engine(small, method=MethodConfig("mtp"))
    runs = sample_runs(lambda i: eng, PROMPT, ALL, CHECKED, V, CONTROL_RUNS, generate=GENERATED)
    assert min(runs.pvalues(exp)[1:]) < 1e-3


def test_mtp_is_the_default_method_of_a_model_that_ships_it(tmp_path, capsys, monkeypatch):
    import json

    from speculant.cli import main
    from speculant.cli_options import default_method

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    with_mtp, without = save_qwen35(tmp_path / "mtp"), save_qwen35(tmp_path / "nomtp", mtp=False)
    assert default_method(str(with_mtp), None) == "mtp"
    assert default_method(str(without), None) == "lookup"
    assert default_method(str(with_mtp), "some-draft") == "hybrid"
    outs = []
    for extra in ([], ["--method", "mtp"], ["--method", "ar"]):  # the default, named, and plain decoding
        rc = main(["generate", "--model", str(with_mtp), *extra, "-n", "12", "--stats", "--no-progress",
                   " ".join(f"t{i}" for i in prompt(12))])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs.append((out, json.loads(err.strip().splitlines()[-1])))
    for out, stats in outs[:2]:
        assert stats["method"] == "mtp" and stats["drafted_tokens"] > 0
        assert out == outs[2][0] and out.strip()
    assert outs[2][1]["method"] == "ar"


def test_the_server_offers_what_a_qwen35_can_run(big, tmp_path):
    from speculant.server.app import offered_methods

    offered = offered_methods(Engine(big, method=MethodConfig("mtp")))
    assert "mtp" in offered and "lookup" in offered and "ar" in offered
    assert "lookup_tree" not in offered  # trees: a recurrent state follows one chain
    plain = load_model(str(save_qwen35(tmp_path / "nomtp", mtp=False)), progress=False, use_cache=False)
    assert "mtp" not in offered_methods(Engine(plain))
    with pytest.raises(SpeculantError, match="--method mtp cannot run on this model: the model ships no"):
        Engine(plain, method=MethodConfig("mtp"))
