"""`speculant train-heads`: self-distillation of a draft head from the target, on this machine's CPU.

Recipe (one run, within `minutes`):
0. with --prompts: the target's own answers to them (answers.py), at most ANSWER_SHARE of the time;
1. text: those answers first, then data.py's default corpus (stdlib sources, package docs) or --data,
   cut into sequences, split into train / validation by document;
2. features: one target forward per sequence (features.py), cached as safetensors; at most
   EXTRACT_SHARE of the time budget, then training uses what was extracted;
3. draft vocabulary: the `draft_vocab` most frequent tokens among the target's own choices and the
   text (FR-Spec / EAGLE-3), output rows started at the target's rows for them;
4. AdamW on the head alone (the target stays frozen), in bf16 autocast where the CPU multiplies bf16 in
   hardware (float32 elsewhere: emulated bf16 is many times slower), until the time or epoch
   budget ends; held-out acceptance measured every `eval_every` steps, the head of the best
   evaluation kept in the output folder (_Best); a resumable checkpoint (head + optimizer,
   safetensors) every CHECKPOINT_SECONDS.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import SpeculantError
from ..heads.config import TRAINABLE, default_config
from ..heads.dflash import DFlashModel, save_dflash
from ..heads.formats import save_head, save_stats
from ..heads.modules import EagleHead, MedusaHeads, build_head, init_from_target
from ..models.native import bf16_native
from .answers import AnswerConfig, answer, answers_folder
from .data import DataConfig, batches, sequences
from .dflash import DFlashObjective, drafter_config, new_drafter
from .features import Features, extract
from .objectives import eagle_loss, medusa_loss

ANSWER_SHARE = 0.35  # of the time budget, at most, for the target's answers to --prompts
EXTRACT_SHARE = 0.5  # of the time budget, at most, for answers and feature extraction together
CHECKPOINT_SECONDS = 60.0
EVAL_SEQS = 32  # validation sequences scored at each evaluation


@dataclass(frozen=True, slots=True)
class TrainConfig:
    method: str
    minutes: float = 5.0
    batch: int = 8
    lr: float | None = None  # None: 3e-3 for medusa, 4e-3 for eagle heads
    steps: int = 3  # unrolled EAGLE draft steps (training-time test)
    # 8,192 draft ids: the output layer is most of an EAGLE step's work, and on SmolLM2 8,192 ids trained
    # more steps per second than 16,384 and ended better held out (docs/measurements.md "Method defaults")
    draft_vocab: int = 8192
    medusa_heads: int = 4
    intermediate: int | None = None  # EAGLE / DFlash layers' MLP width (None: the target's)
    epochs: int = 50
    eval_every: int = 50
    seed: int = 0
    # DFlash: the block (anchor + drafts) and the drafter's layers; small, for a CPU budget (z-lab's are 16 and 5)
    block: int = 8
    layers: int = 1
    anchors: int = 16  # blocks trained per sequence and step

    def __post_init__(self) -> None:
        if self.method not in TRAINABLE:
            raise SpeculantError(f"unknown --method {self.method!r}; choose one of {', '.join(TRAINABLE)}")
        if not self.minutes > 0:
            raise SpeculantError(f"--minutes must be > 0, got {self.minutes}")
        if not 2 <= self.block <= 64:
            raise SpeculantError(f"--block must be in 2..64 (the anchor and its drafts), got {self.block}")
        for name in ("batch", "steps", "draft_vocab", "medusa_heads", "epochs", "eval_every", "layers", "anchors"):
            if getattr(self, name) < 1:
                raise SpeculantError(f"train-heads {name} must be >= 1, got {getattr(self, name)}")
        if self.lr is not None and not 0 < self.lr < 1:
            raise SpeculantError(f"--lr must be in (0, 1), got {self.lr}")

    @property
    def learning_rate(self) -> float:
        # few steps fit in a CPU budget: rates at the high end of what stays stable (measured on SmolLM2)
        return self.lr if self.lr is not None else (3e-3 if self.method == "medusa" else 4e-3)


class Trainer:
    """One head (or DFlash drafter, whose loss is DFlashObjective's) being trained: its losses, evaluation and
    checkpoints."""

    def __init__(self, target, head: MedusaHeads | EagleHead | DFlashModel, tcfg: TrainConfig,
                 objective: DFlashObjective | None = None) -> None:
        self.target, self.head, self.tcfg, self.objective = target, head, tcfg, objective
        params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=tcfg.learning_rate, weight_decay=0.0, betas=(0.9, 0.95))
        self.step = 0
        self.epoch = 0
        self.bf16 = bf16_native()

    def _loss(self, f: Features, idx: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if self.objective is not None:
            return self.objective(f, idx)
        feats, ids, p = f.feats[idx], f.top_ids[idx], f.top_p[idx]
        if isinstance(self.head, MedusaHeads):
            return medusa_loss(self.head, feats, ids, p)
        tokens = f.tokens[idx]  # [B, T]
        with torch.no_grad():
            nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1)
            emb = self.target.embed(nxt.flatten()).view(*nxt.shape, -1).float().clone()  # row i: token i+1
        m = self.target
        regress = feats if self.head.cfg.method == "eagle2" else None
        return eagle_loss(self.head, emb, feats, ids, p, self.tcfg.steps, m.cos, m.sin, regress)

    def train_step(self, f: Features, idx: torch.Tensor) -> float:
        self.head.train()
        warm = min(1.0, (self.step + 1) / 20)  # linear warmup
        for g in self.opt.param_groups:
            g["lr"] = self.tcfg.learning_rate * warm
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss, _ = self._loss(f, idx)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.head.parameters() if p.requires_grad], 1.0)
        self.opt.step()
        self.step += 1
        return loss.item()

    @torch.no_grad()
    def evaluate(self, f: Features) -> dict:
        """Held-out loss and acceptance: per head / step top-1 agreement with the target; for EAGLE the
        mean drafts a chain of `steps` gets accepted; for Medusa the rank-r hit rates (static tree)."""
        self.head.eval()
        n = min(EVAL_SEQS, f.n)
        out: dict[str, list] = {}
        losses = []
        for s in range(0, n, self.tcfg.batch):
            loss, m = self._loss(f, torch.arange(s, min(s + self.tcfg.batch, n)))
            losses.append(float(loss))
            for k, v in m.items():
                out.setdefault(k, []).append(v)
        res = {"loss": sum(losses) / len(losses)}
        for k, vs in out.items():
            res[k] = torch.stack(vs).float().mean(0).tolist()
        return res

    def save_checkpoint(self, folder: Path, meta: dict) -> None:
        state = {f"head.{k}": v.detach().contiguous() for k, v in self.head.state_dict().items()}
        for pid, st in self.opt.state_dict()["state"].items():
            for k, v in st.items():
                state[f"opt.{pid}.{k}"] = v.detach().reshape(-1).contiguous() if v.dim() == 0 else v.detach().contiguous()
        tmp = folder / "checkpoint.safetensors.tmp"
        save_file(state, str(tmp))
        tmp.replace(folder / "checkpoint.safetensors")
        (folder / "checkpoint.json").write_text(json.dumps({**meta, "step": self.step, "epoch": self.epoch}))

    def load_checkpoint(self, folder: Path, meta: dict) -> bool:
        """Resume from `folder`'s checkpoint if it was made by the same recipe; returns whether it did."""
        js, st = folder / "checkpoint.json", folder / "checkpoint.safetensors"
        if not (js.is_file() and st.is_file()):
            return False
        saved = json.loads(js.read_text())
        if {k: saved.get(k) for k in meta} != meta:
            return False
        t = load_file(str(st))
        self.head.load_state_dict({k[5:]: v for k, v in t.items() if k.startswith("head.")})
        osd = self.opt.state_dict()
        for pid in osd["param_groups"][0]["params"]:
            keys = {k.split(".", 2)[2]: v for k, v in t.items() if k.startswith(f"opt.{pid}.")}
            if keys:
                osd["state"][pid] = {k: (v.reshape(()) if k == "step" else v) for k, v in keys.items()}
        self.opt.load_state_dict(osd)
        self.step, self.epoch = int(saved["step"]), int(saved["epoch"])
        return True


def choose_vocab(f: Features, size: int, vocab: int) -> torch.Tensor:
    """The `size` target ids most frequent among the target's choices (x2) and the text: d2t [size], ascending."""
    counts = torch.bincount(f.top_ids[..., 0].flatten(), minlength=vocab)[:vocab] * 2
    counts += torch.bincount(f.tokens.flatten(), minlength=vocab)[:vocab]
    return counts.topk(min(size, vocab)).indices.sort().values


def train(target, tcfg: TrainConfig, dcfg: DataConfig, files: list[Path], out: Path, progress: bool = True,
          prompts: list[str] | None = None, acfg: AnswerConfig = AnswerConfig()) -> dict:
    """Train a head (or DFlash drafter) for `target` (a LoadedModel) and save it in `out`; returns its stats.
    `prompts`: train on the target's answers to them first (answers.py)."""
    t0 = time.monotonic()
    deadline = t0 + tcfg.minutes * 60
    torch.manual_seed(tcfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    model = target.model
    if tcfg.method == "dflash":
        if dcfg.seq_len <= tcfg.block:
            raise SpeculantError(f"--seq-len {dcfg.seq_len} leaves no anchor for a block of {tcfg.block}; give a "
                                 "longer --seq-len or a smaller --block")
        raw = drafter_config(target.config, tcfg.block, tcfg.layers, tcfg.intermediate)
        drafter = new_drafter(raw, target.config, tcfg.seed)
        taps, desc = drafter.cfg.taps(target.config.n_layers), raw

        def save(head, folder: Path, stats: dict) -> None:
            save_dflash(head, raw, folder, stats)
    else:
        from dataclasses import replace

        cfg = replace(default_config(tcfg.method, target.config, tcfg.draft_vocab, medusa_heads=tcfg.medusa_heads,
                                     intermediate=tcfg.intermediate), target=target.name)
        drafter, taps, desc, save = None, cfg.taps, cfg.to_dict(), save_head
    with _Progress(progress, tcfg.minutes * 60) as bar:
        first: list[Path] = []
        if prompts:
            bar.phase(f"answers ({len(prompts)} prompts, up to {acfg.max_tokens} tokens)", len(prompts))
            first = answer(target, prompts, acfg, answers_folder(out.parent / ".answers", target, prompts, acfg),
                           t0 + ANSWER_SHARE * tcfg.minutes * 60, bar.advance)
            if not first:
                raise SpeculantError("--minutes left no time to answer a prompt; give more minutes")
        train_tok, val_tok, fp = sequences(target.tokenizer, files, dcfg, first)
        tag = f"{Path(str(target.path)).name}-{target.dtype}-{fp}-taps{'_'.join(map(str, taps))}"
        feat_dir = out.parent / ".features" / tag
        total = train_tok.shape[0] + val_tok.shape[0]
        bar.phase(f"features ({total} x {dcfg.seq_len} tokens)", total)
        val = extract(model, val_tok, taps, feat_dir / "val", bar.advance)
        try:
            tr = extract(model, train_tok, taps, feat_dir / "train", bar.advance,
                         deadline=t0 + EXTRACT_SHARE * tcfg.minutes * 60)
        except TimeoutError:
            raise SpeculantError("--minutes left no time to extract training features; give more minutes") from None
        t_extract = time.monotonic() - t0
        head, objective, vocab = drafter, None, target.config.vocab_size
        if head is None:
            head = build_head(cfg)
            head.set_vocab(choose_vocab(tr, cfg.draft_vocab, cfg.vocab))
            init_from_target(head, model)
        else:
            objective = DFlashObjective(head, model, tcfg.anchors, tcfg.seed, choose_vocab(tr, tcfg.draft_vocab, vocab))
        trainer = Trainer(model, head, tcfg, objective)
        meta = {"head": desc, "data": fp, "train": {k: v for k, v in asdict(tcfg).items() if k not in ("minutes", "epochs", "eval_every")}}
        resumed = trainer.load_checkpoint(out, meta)
        bar.phase("training", None)
        metrics = start_metrics = trainer.evaluate(val)
        best = _Best(out, resumed, save)
        last_ckpt, loss = time.monotonic(), math.nan
        while trainer.epoch < tcfg.epochs and time.monotonic() < deadline:
            for idx in batches(tr.n, min(tcfg.batch, tr.n), tcfg.seed, trainer.epoch):
                if time.monotonic() >= deadline:
                    break
                loss = trainer.train_step(tr, idx)
                if trainer.step % tcfg.eval_every == 0:
                    metrics = trainer.evaluate(val)
                    best.offer(head, metrics, trainer.step)
                bar.show(trainer.epoch, trainer.step, loss, metrics)
                if time.monotonic() - last_ckpt > CHECKPOINT_SECONDS:
                    trainer.save_checkpoint(out, meta)
                    last_ckpt = time.monotonic()
            else:
                trainer.epoch += 1
        metrics = trainer.evaluate(val)
        bar.show(trainer.epoch, trainer.step, loss, metrics)
        trainer.save_checkpoint(out, meta)
    stats = {"val": metrics, "val_start": start_metrics, "steps": trainer.step, "epochs": trainer.epoch, "resumed": resumed,
             "train_tokens": int(tr.tokens.numel()), "val_tokens": int(val.tokens.numel()), "answers": len(first),
             "extract_seconds": round(t_extract, 1), "total_seconds": round(time.monotonic() - t0, 1),
             "data": fp, "recipe": asdict(tcfg), "seq_len": dcfg.seq_len}
    best.offer(head, metrics, trainer.step, stats)
    return {**stats, **best.stats}


def _score(metrics: dict) -> tuple[float, float]:
    """What the kept head maximizes: held-out drafts a chain or block gets accepted (EAGLE, DFlash) or head 1's top-1
    hit rate (Medusa), then the lower held-out loss."""
    return float(metrics["chain"] if "chain" in metrics else metrics["acc"][0]), -float(metrics["loss"])


class _Best:
    """The head as of its best held-out evaluation, saved in `out` (the head methods load that one).

    With a few hundred thousand training tokens a head overfits after 2-3 epochs (SmolLM2: held-out
    top-1 flat from epoch 2 while the training top-1 kept rising), so a long budget must not hand the
    user a worse head than an earlier step had. The resumable checkpoint keeps the latest state; a
    resumed run starts from the kept head's score."""

    def __init__(self, out: Path, resumed: bool, save=save_head) -> None:
        self.out, self.save = out, save  # save(head, folder, stats): the head's own layout
        saved = self._saved() if resumed else None
        self.score = _score(saved["val"]) if saved and "val" in saved else (-math.inf, -math.inf)
        self.stats = {k: saved[k] for k in ("val", "best_step") if k in saved} if saved else {}

    def _saved(self) -> dict | None:
        cfg = self.out / "config.json"
        return json.loads(cfg.read_text()).get("stats", {}) if (self.out / "model.safetensors").is_file() and cfg.is_file() else None

    def offer(self, head, metrics: dict, step: int, final: dict | None = None) -> None:
        """A held-out evaluation at `step`; `final`: the run's stats (the last call), written beside the kept head."""
        if _score(metrics) > self.score:
            self.score, self.stats = _score(metrics), {"val": metrics, "best_step": step}
            self.save(head, self.out, {**(final or {"steps": step, "partial": True}), **self.stats})
        elif final is not None:
            self.stats["val_last"] = metrics
            save_stats(self.out, {**final, **self.stats})


class _Progress:
    """A rich progress bar on stderr: extraction progress, then training time with loss and acceptance."""

    def __init__(self, enabled: bool, seconds: float) -> None:
        self.enabled, self.seconds = enabled, seconds
        self.t0 = time.monotonic()

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.p = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                              TimeElapsedColumn(), console=Console(stderr=True))
            self.p.__enter__()
            self.task = self.p.add_task("", total=1, info="")
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.p.__exit__(*exc)

    def phase(self, name: str, total: int | None) -> None:
        if self.enabled:
            if total is None:  # training: the bar is the time budget
                self.p.update(self.task, description=name, total=self.seconds, completed=time.monotonic() - self.t0)
            else:
                self.p.update(self.task, description=name, total=total, completed=0)

    def advance(self, n: int) -> None:
        if self.enabled:
            self.p.advance(self.task, n)

    def show(self, epoch: int, step: int, loss: float, m: dict) -> None:
        if not self.enabled:
            return
        acc = " ".join(f"{a:.2f}" for a in m.get("acc", []))
        extra = f" chain {m['chain'][0] if isinstance(m['chain'], list) else m['chain']:.2f}" if "chain" in m else ""
        self.p.update(self.task, completed=time.monotonic() - self.t0,
                      info=f"epoch {epoch} step {step} loss {loss:.3f} | held-out loss {m['loss']:.3f} top-1 {acc}{extra}")
