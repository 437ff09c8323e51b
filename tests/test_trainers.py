"""HF Trainer and accelerate's loop, run as their users run them, with the model under tiered_offload: the same
losses, gradient norms, weights and checkpoints as without it (see [Note: torch's loop helpers inside the
context] in tiermem/optim/loop_helpers.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests import models
from tiermem import tiered_offload

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from torch.utils.data import DataLoader, Dataset  # noqa: E402


class Tokens(Dataset):
    """Eight sequences of 8 token ids, each its own label (causal LM)."""

    def __init__(self, n: int = 8) -> None:
        self.ids = [torch.randint(0, 500, (8,), generator=torch.Generator().manual_seed(k)) for k in range(n)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def cfg(tmp_path: Path) -> dict[str, Any]:
    return {"device": "cpu", "params.tier": "nvme", "optimizer.tier": "nvme", "nvme.paths": [str(tmp_path / "swap")],
            "memory.host_budget": "8MiB", "wrap.min_unit_bytes": 0}


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = models.gpt2().train()  # dropout on: the offloaded model draws the same random numbers
    model.config.use_cache = False
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]


def trainer_args(out: Path, **kw: Any) -> Any:
    from transformers import TrainingArguments

    args = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_grad_norm": 0.05,
            "max_steps": 4, "logging_steps": 1, "report_to": [], "use_cpu": True, "save_strategy": "no",
            "dataloader_num_workers": 0, "seed": 0, "disable_tqdm": True, **kw}
    return TrainingArguments(output_dir=str(out), **args)


def run_trainer(tmp_path: Path, offloaded: bool, scheduler: str, **kw: Any) -> tuple[list[Any], dict[str, Any], Any]:
    """Trainer.train() then evaluate() from the same seed, in memory or under tiered_offload: (loss, grad_norm)
    per step and ("eval", its loss), the weights after, and the Trainer."""
    from transformers import Trainer

    torch.manual_seed(0)
    model, opt = model_and_optimizer()
    # "before": a StepLR made before the context; "trainer": the Trainer's own, made inside train()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5) if scheduler == "before" else None
    trainer = Trainer(model=model, args=trainer_args(tmp_path / ("tm" if offloaded else "mem"), **kw),
                      train_dataset=Tokens(), optimizers=(opt, sched))
    if offloaded:
        with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
            trainer.train()
            evaluated = trainer.evaluate(Tokens(4))["eval_loss"]
            assert tm.stats()["bytes_read"] > 0
    else:
        trainer.train()
        evaluated = trainer.evaluate(Tokens(4))["eval_loss"]
    logged = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    return [*logged, ("eval", evaluated)], weights(model), trainer


# transformers 5 renamed the argument (the old name still works, with a warning)
_CHECKPOINTING = next(n for n in ("activation_checkpointing", "gradient_checkpointing")
                      if n in transformers.TrainingArguments.__dataclass_fields__)
TRAINER_CASES = {  # id: (the scheduler, TrainingArguments beside trainer_args')
    "StepLR-before-clip": ("before", {"gradient_accumulation_steps": 1}),
    "its-own-scheduler-accumulate-clip": ("trainer", {}),
    "accumulate-no-clip": ("trainer", {"max_grad_norm": 0.0}),
    "bf16-autocast": ("trainer", {"bf16": True}),
    "gradient-checkpointing": ("trainer", {_CHECKPOINTING: True}),
}


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_hf_trainer_trains_as_in_memory(tmp_path, compute_device, case: str) -> None:
    """Trainer(model, args, optimizers=(opt, sched)).train() under tiered_offload(model, optimizer=opt), then
    trainer.evaluate(): its logged losses and gradient norms, the evaluation loss and the weights equal the
    Trainer's in memory, bit for bit. Before, the Trainer's clipping (accelerate's, over parameters whose .grad
    is None here) logged a norm of 0 and clipped nothing, and a scheduler (the Trainer's own, made in train())
    changed param-group dicts the tiers no longer read once accelerate's prepare() had reloaded the optimizer:
    the learning rate stayed at its first value."""
    scheduler, kw = TRAINER_CASES[case]
    want, want_w, _ = run_trainer(tmp_path, False, scheduler, **kw)
    got, got_w, trainer = run_trainer(tmp_path, True, scheduler, **kw)
    assert len(want) == 5 and got == want  # four steps and the evaluation
    assert differing(want_w, got_w) == []
    if kw.get("max_grad_norm", 0.05):
        assert all(norm > 0.05 for _, norm in want[:-1])  # clipping clips at every step
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert len(set(lrs)) > 1  # the schedule moved the learning rate


def test_hf_trainer_checkpoints_and_resumes_as_in_memory(tmp_path, compute_device) -> None:
    """A Trainer saving a checkpoint at step 2 under tiered_offload writes the trained weights and the optimizer
    state from the tiers (the optimizer.pt of an in-memory run, value for value), and a fresh model and context
    resuming from it with train(resume_from_checkpoint=...) end where the in-memory run resumed from its own
    checkpoint ends. Before, optimizer.state_dict() was the original optimizer's, empty inside the context."""
    from transformers import Trainer

    def resumed(offloaded: bool) -> dict[str, torch.Tensor]:
        out = tmp_path / ("tm" if offloaded else "mem")
        for resume in (False, True):
            torch.manual_seed(0)
            model, opt = model_and_optimizer()
            args = trainer_args(out, save_strategy="steps", save_steps=2, max_steps=2 if not resume else 4)
            trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None))
            start = str(out / "checkpoint-2") if resume else None
            if offloaded:
                with tiered_offload(model, optimizer=opt, **cfg(tmp_path / f"swap{resume}")):
                    trainer.train(resume_from_checkpoint=start)
            else:
                trainer.train(resume_from_checkpoint=start)
        return weights(model)

    want = resumed(False)
    got = resumed(True)
    assert differing(want, got) == []
    mem, tm = (torch.load(tmp_path / d / "checkpoint-2" / "optimizer.pt", weights_only=True) for d in ("mem", "tm"))
    assert len(mem["state"]) == len(tm["state"]) == len(list(models.gpt2().parameters()))
    for k, entry in mem["state"].items():
        assert set(entry) == set(tm["state"][k]) and all(torch.equal(v, tm["state"][k][n]) for n, v in entry.items())
    assert [g["lr"] for g in mem["param_groups"]] == [g["lr"] for g in tm["param_groups"]]


def test_an_accelerate_loop_trains_as_in_memory(tmp_path, compute_device) -> None:
    """accelerate's documented loop (prepare, accumulate(model), accelerator.backward, clip_grad_norm_ when
    gradients sync, a scheduler) under tiered_offload: the norms it returns and the weights equal the same loop's
    in memory."""
    from accelerate import Accelerator

    def train(offloaded: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model, opt = model_and_optimizer()
        accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
        norms: list[float] = []

        def loop() -> None:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            m, o, data, s = accelerator.prepare(model, opt, DataLoader(Tokens(), batch_size=2), sched)
            for batch in data:
                with accelerator.accumulate(m):
                    accelerator.backward(m(**batch).loss)
                    if accelerator.sync_gradients:
                        norms.append(float(accelerator.clip_grad_norm_(m.parameters(), 0.05)))
                    o.step()
                    s.step()
                    o.zero_grad()

        if offloaded:
            with tiered_offload(model, optimizer=opt, **cfg(tmp_path)):
                loop()
        else:
            loop()
        accelerator.free_memory()
        return norms, weights(model)

    want, want_w = train(False)
    got, got_w = train(True)
    assert len(want) == 2 and all(n > 0.05 for n in want) and got == want
    assert differing(want_w, got_w) == []


def test_a_scheduler_made_inside_the_context_steps_the_tiers(tmp_path, compute_device) -> None:
    """A scheduler made inside the context (as HF Trainer makes its own) drives the learning rate of the tiers'
    updates, and one made before it does not warn that step() was replaced. Before, one made inside wrapped the
    tiers' step() as a method of the original optimizer, and the first step raised AttributeError."""
    import warnings

    data = [torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(k)) for k in range(3)]
    results = []
    for offloaded in (False, True):
        model, opt = model_and_optimizer()
        model.eval()
        before = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns when step() looks replaced after a scheduler was made
            with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) if offloaded else _nothing():
                inside = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
                for x in data:
                    model(x, labels=x).loss.backward()
                    opt.step()
                    before.step()
                    inside.step()
                    opt.zero_grad()
        results.append(weights(model))
    assert differing(*results) == []


def test_step_hooks_registered_on_the_optimizer_run_around_the_tiers_step(tmp_path) -> None:
    """register_step_pre_hook / register_step_post_hook on the optimizer passed in, before the context and
    inside it: each is called once per step with that optimizer, the pre hook before the step recorded its
    update and the post hook after, as in memory they run around the update. Before, the tiers' step skipped
    them."""
    seen: list[tuple[str, bool, bool]] = []  # (which, given the optimizer passed in, an update pending)
    model, opt = model_and_optimizer()
    model.eval()
    x = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)) as tm:
        opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", o is opt, tm.optimizer.has_pending())))
        post = opt.register_step_post_hook(lambda o, a, k: seen.append(("post", o is opt,
                                                                        tm.optimizer.has_pending())))
        for _ in range(2):
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        post.remove()
        model(x, labels=x).loss.backward()
        opt.step()
    assert seen == [("pre", True, False), ("post", True, True)] * 2 + [("pre", True, False)]


@pytest.mark.parametrize("case", ["trainer-builds-its-own", "second-optimizer", "context-without-optimizer"])
def test_stepping_an_optimizer_the_context_was_not_given_is_an_error_naming_the_fix(tmp_path, case: str) -> None:
    """An optimizer other than the one passed to tiered_offload, stepping the model's parameters inside the
    context (HF Trainer not handed one builds its own; a second one; one beside a context entered without an
    optimizer), raises before it changes anything, naming the optimizer to pass; the weights are untouched and
    the same optimizer steps again normally after the context. Before, the first two updated nothing, silently,
    and the third failed in torch's AdamW on a placeholder's size."""
    from transformers import Trainer

    from tiermem import OffloadError

    model, opt = model_and_optimizer()
    model.eval()
    before = weights(model)
    x = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    given = None if case == "context-without-optimizer" else opt
    fix = "entered without an optimizer" if given is None else "step that one"
    with pytest.raises(OffloadError, match=rf"AdamW.step\(\): this optimizer holds parameters of the "
                                           rf"GPT2LMHeadModel under tiered_offload.*{fix}"):
        with tiered_offload(model, optimizer=given, **cfg(tmp_path)):
            if case == "trainer-builds-its-own":
                Trainer(model=model, args=trainer_args(tmp_path / "out", max_steps=1),
                        train_dataset=Tokens()).train()
            other = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model(x, labels=x).loss.backward()
            other.step()
    assert differing(before, weights(model)) == []
    other = torch.optim.AdamW(model.parameters(), lr=1e-2)  # outside, torch's as ever
    model(x, labels=x).loss.backward()
    other.step()
    assert differing(before, weights(model)) != []


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def test_optimizer_state_dict_inside_the_context_is_the_tiers(tmp_path, compute_device) -> None:
    """Inside the context the original optimizer's state_dict() returns the state from the tiers (what
    torch.save of it keeps), and its load_state_dict() loads into them: a run that saves after 2 steps, loads
    that into a fresh context and takes 2 more ends where 4 steps in memory end."""
    data = [torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(k)) for k in range(4)]

    def steps(model: nn.Module, opt: torch.optim.Optimizer, batch: list[torch.Tensor]) -> None:
        for x in batch:
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()

    model, opt = model_and_optimizer()
    model.eval()
    steps(model, opt, data[:2])
    halfway = {k: {n: v.clone() for n, v in e.items()} for k, e in opt.state_dict()["state"].items()}
    steps(model, opt, data[2:])
    want = weights(model)

    model, opt = model_and_optimizer()
    model.eval()
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path / "a")):
        steps(model, opt, data[:2])
        saved = opt.state_dict()
        sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert opt.state_dict()["state"] == {}  # the original's own, outside: the state stayed in the tiers
    assert halfway.keys() == saved["state"].keys()
    assert all(torch.equal(v, saved["state"][k][n]) for k, e in halfway.items() for n, v in e.items())
    model, opt = model_and_optimizer()
    model.eval()
    model.load_state_dict(sd)
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path / "b")):
        opt.load_state_dict(saved)
        steps(model, opt, data[2:])
    assert differing(want, weights(model)) == []


def test_accelerate_imported_inside_the_context_clips_in_the_tiers(tmp_path) -> None:
    """accelerate imported only after the context began (transformers imports it with its Trainer, on first
    use) still clips the tiers' gradients: the norm its clip_grad_norm_ returns is torch's in memory."""
    script = textwrap.dedent(f"""
        import sys, torch
        from tiermem import tiered_offload
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
        norms = []
        for offloaded in (False, True):
            torch.manual_seed(0)  # a plain torch model: transformers' models import accelerate with them
            model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            if offloaded:
                with tiered_offload(model, optimizer=opt, device="cpu", **{{"params.tier": "nvme",
                        "nvme.paths": [{str(tmp_path / "swap")!r}], "wrap.min_unit_bytes": 0}}):
                    model(x).square().sum().backward()
                    assert "accelerate.accelerator" not in sys.modules
                    from accelerate import Accelerator
                    norms.append(float(Accelerator(cpu=True).clip_grad_norm_(model.parameters(), 0.05)))
            else:
                model(x).square().sum().backward()
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        print(norms)
        assert norms[0] > 0.05 and norms[1] == norms[0], norms
        assert Accelerator.clip_grad_norm_.__module__.startswith("accelerate"), "put back when the context ended"
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_wrapping_the_model_in_ddp_without_a_process_group_is_an_error_naming_the_fix(tmp_path) -> None:
    """DistributedDataParallel(model) of a model under tiered_offload in a process without torch.distributed
    says to initialise it first (as torch's DDP would, in tiermem's words); torch's DDP is put back at exit.
    Before wrapping was supported, backward failed deep in autograd ("invalid gradient ... expected shape
    compatible with [0]")."""
    from torch.nn.parallel import DistributedDataParallel

    from tiermem import OffloadError

    torch_init = DistributedDataParallel.__init__
    model, opt = model_and_optimizer()
    with tiered_offload(model, optimizer=opt, **cfg(tmp_path)):
        with pytest.raises(OffloadError, match=r"DistributedDataParallel\(GPT2LMHeadModel\): torch.distributed is "
                                               r"not initialised; call init_process_group"):
            DistributedDataParallel(model)
    assert DistributedDataParallel.__init__ is torch_init


def test_hf_trainer_fine_tunes_lora_on_a_meta_base_as_in_memory(tmp_path, compute_device) -> None:
    """The fine-tune that does not fit, through the Trainer: LoRA adapters (PEFT) on a base built on the meta
    device and streamed from its checkpoint, three clipped steps with the Trainer's own scheduler: the logged
    losses and gradient norms and the adapters equal the Trainer's on the base in memory."""
    peft = pytest.importorskip("peft")
    import transformers
    from transformers import Trainer

    from tests import test_finetune as ft

    base, path = ft.base_checkpoint(tmp_path)

    def train(model: nn.Module, out: Path, offload: dict[str, Any] | None) -> list[Any]:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

        def make() -> Any:  # the Trainer moves the model to its device when made: a meta model only inside
            return Trainer(model=model, args=trainer_args(out, max_steps=3, gradient_accumulation_steps=1),
                           train_dataset=Tokens(), optimizers=(opt, None))

        if offload is None:
            (trainer := make()).train()
        else:
            with tiered_offload(model, optimizer=opt, **offload):
                (trainer := make()).train()
        return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]

    torch.manual_seed(123)
    ref = peft.get_peft_model(base, ft.lora_config())
    want = train(ref, tmp_path / "mem", None)
    with torch.device("meta"):
        meta_base = transformers.GPT2LMHeadModel(ft.gpt2_config())
    torch.manual_seed(123)
    model = peft.get_peft_model(meta_base, ft.lora_config())
    got = train(model, tmp_path / "tm", {"checkpoint": path, "init_missing": ["*.lora_*"], "init_seed": 123,
                                         **ft.cfg(tmp_path)})
    assert len(want) == 3 and got == want
    trained = dict(model.named_parameters())
    lora = [n for n, _ in ref.named_parameters() if "lora_" in n]
    assert lora and [n for n, p in ref.named_parameters() if n in lora and not torch.equal(p, trained[n])] == []


def no_dropout(model: nn.Module) -> nn.Module:
    """Dropout off: each rank draws its own masks, and DDP's and the tiers' runs would draw them differently."""
    model.config.use_cache = False
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.train()


def _trainer_on_ranks(rank: int, world: int, folder: Path) -> None:
    """Rank `rank` of test_hf_trainer_under_torchrun_keeps_its_ddp_wrapper_and_trains_as_ddp_in_memory."""
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Trainer

    from tiermem import OffloadError
    from tiermem.optim.ddp import TieredDDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", LOCAL_WORLD_SIZE=str(world))  # as torchrun sets

    def train(offloaded: bool) -> tuple[list[Any], dict[str, torch.Tensor], Any]:
        torch.manual_seed(0)
        model = no_dropout(models.gpt2())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        args = trainer_args(folder / f"{'tm' if offloaded else 'mem'}{rank}", ddp_backend="gloo")
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None))
        if offloaded:
            with tiered_offload(model, optimizer=opt, **cfg(folder / f"r{rank}")) as tm:
                trainer.train()
                assert tm.stats()["gathered_bytes"] > 0  # sharded: each rank holds half of every unit
        else:
            trainer.train()
        logged = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
        return logged, weights(model), trainer.model_wrapped

    want, want_w, ddp = train(False)
    got, got_w, wrapped = train(True)
    assert type(ddp) is DistributedDataParallel and type(wrapped) is TieredDDP, (ddp, wrapped)
    assert isinstance(wrapped, DistributedDataParallel) and wrapped.module is not None
    assert len(want) == 4 and all(norm > 0.05 for _, norm in want)  # the Trainer clipped at every step
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for n in want_w:
        torch.testing.assert_close(got_w[n], want_w[n], rtol=0, atol=1e-6, msg=n)
    with pytest.raises(OffloadError, match="context that has ended"):
        wrapped(input_ids=torch.zeros(1, 4, dtype=torch.long))

    def made_before(offloaded: bool) -> dict[str, torch.Tensor]:  # a torchrun script: DDP(model), then the loop
        torch.manual_seed(0)
        model = no_dropout(models.gpt2())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ddp = DistributedDataParallel(model)
        seeds = [torch.Generator().manual_seed(10 * k + rank) for k in range(3)]
        batches = [torch.randint(0, 500, (2, 8), generator=g) for g in seeds]
        context = tiered_offload(model, optimizer=opt, **cfg(folder / f"b{rank}"))
        with context if offloaded else contextlib.nullcontext():
            for ids in batches:
                ddp(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
        assert type(ddp) is (TieredDDP if offloaded else DistributedDataParallel)
        assert ("reducer" in ddp.__dict__) is not offloaded  # its buckets, a copy of the gradients, let go
        return weights(model)

    want_w, got_w = made_before(False), made_before(True)
    for n in want_w:
        torch.testing.assert_close(got_w[n], want_w[n], rtol=0, atol=1e-6, msg=n)

    model, opt = model_and_optimizer()
    with pytest.raises(OffloadError, match=r"given the DDP wrapper; pass the model itself, tiered_offload\(ddp.module"):
        tiered_offload(DistributedDataParallel(model), optimizer=opt, **cfg(folder / f"z{rank}")).__enter__()
    alone = torch.distributed.new_group([rank]) if rank == 0 else torch.distributed.new_group([0])
    alone = torch.distributed.new_group([1]) if rank == 1 else alone  # every rank makes both groups, in order
    with tiered_offload(model, optimizer=opt, **cfg(folder / f"x{rank}")) as tm:
        refusals = {"mixed_precision": dict(mixed_precision=object()), "device_ids": dict(device_ids=["meta"]),
                    "device_mesh": dict(device_mesh=object()), "process_group": dict(process_group=alone)}
        for key, kw in refusals.items():
            with pytest.raises(OffloadError, match=rf"DistributedDataParallel\(GPT2LMHeadModel\).*{key}"):
                DistributedDataParallel(model, **kw)
        wrapped = DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=1)
        with pytest.raises(OffloadError, match="register_comm_hook.*leave the hook out"):
            wrapped.register_comm_hook(None, lambda state, bucket: None)
        with pytest.raises(OffloadError, match="join.*uneven inputs"):
            wrapped.join()
        with wrapped.no_sync():
            wrapped(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
        assert tm.stats()["gathered_bytes"] > 0

    torch.distributed.destroy_process_group()  # a context entered before the process group: each rank alone
    model, opt = model_and_optimizer()
    with tiered_offload(model, optimizer=opt, **cfg(folder / f"y{rank}")):
        torch.distributed.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-again", rank=rank,
                                             world_size=world)
        with pytest.raises(OffloadError, match="entered with one.*enter the context after init_process_group"):
            DistributedDataParallel(model)


def test_hf_trainer_under_torchrun_keeps_its_ddp_wrapper_and_trains_as_ddp_in_memory(tmp_path) -> None:
    """HF Trainer on 2 ranks (gloo, launched as torchrun launches it) wraps the model in DistributedDataParallel,
    as accelerate's prepare() does. Under tiered_offload the wrapper is kept, a TieredDDP whose tiers shard the
    model and average its gradients, and 4 steps of SGD with momentum, clipping and 2-step accumulation end as
    the same Trainer with torch's DDP in memory: losses and norms to 1e-5, weights to 1e-6 (rounding: the tiers
    reduce each micro-batch, DDP the accumulated sum). Before, the wrap was refused. DDP's arguments that would
    change what is computed (mixed_precision, device_mesh, another device or process group), comm hooks and
    join() are refused naming the fix, as is the wrap of a context entered before the process group began; the
    wrapper refuses to run once its context has ended. A torchrun script's DDP(model), made before the context,
    becomes the tiers' at its first forward there, letting its reducer go, and three steps end as torch's DDP in
    memory (before, DDP's forward failed on a placeholder's size)."""
    from tests.ranks import run_ranks

    run_ranks(_trainer_on_ranks, 2, tmp_path, timeout_s=120)


def _trainer_checkpoints_on_ranks(rank: int, world: int, folder: Path) -> None:
    """Rank `rank` of test_hf_trainer_under_torchrun_saves_checkpoints_and_resumes_as_ddp_in_memory."""
    from transformers import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29557", LOCAL_WORLD_SIZE=str(world))  # as torchrun sets

    def train(where: str, resume: str | None = None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = no_dropout(models.gpt2())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # AdamW's first steps amplify rounding
        args = trainer_args(folder / where, ddp_backend="gloo", save_strategy="steps", save_steps=2)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None))
        if where == "memory":
            trainer.train()
        else:
            with tiered_offload(model, optimizer=opt, **cfg(folder / f"{where}-swap{rank}")):
                trainer.train(resume_from_checkpoint=resume)
        return weights(model)

    want = train("memory")
    got = train("tiers")
    resumed = train("resumed", str(folder / "tiers" / "checkpoint-2"))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6, msg=n)
        torch.testing.assert_close(resumed[n], want[n], rtol=0, atol=1e-6, msg=n)
    if rank == 0:
        from safetensors.torch import load_file

        for step in (2, 4):
            mem, tiers = (folder / where / f"checkpoint-{step}" for where in ("memory", "tiers"))
            saved, kept = load_file(str(mem / "model.safetensors")), load_file(str(tiers / "model.safetensors"))
            assert set(saved) == set(kept)
            for n in saved:
                torch.testing.assert_close(kept[n], saved[n], rtol=0, atol=1e-6, msg=n)
            saved, kept = (torch.load(d / "optimizer.pt", weights_only=True)["state"] for d in (mem, tiers))
            assert set(saved) == set(kept) and saved
            for k in saved:  # whole tensors, not this rank's chunks
                torch.testing.assert_close(kept[k]["momentum_buffer"], saved[k]["momentum_buffer"], rtol=0, atol=1e-6,
                                           msg=str(k))


def test_hf_trainer_under_torchrun_saves_checkpoints_and_resumes_as_ddp_in_memory(tmp_path) -> None:
    """HF Trainer on 2 ranks saving a checkpoint every 2 of 4 steps (SGD with momentum, clipping, 2-step
    accumulation, a linear schedule), under
    tiered_offload: its model.safetensors and optimizer.pt hold the whole weights and state, as the same Trainer
    with torch's DDP in memory writes them (to 1e-6: the tiers reduce each micro-batch); and a fresh model and
    context resuming from checkpoint-2 end where the in-memory run ends. Before, only the saving rank reached
    model.state_dict(), whose gathers need every rank: they met the other rank's next collective (gloo aborted
    on the mismatch, or both waited for the process group's timeout), and optimizer.state_dict() gave a
    rank's chunks. The tied head is saved once, as in memory."""
    from tests.ranks import run_ranks

    run_ranks(_trainer_checkpoints_on_ranks, 2, tmp_path, timeout_s=120)


def test_hf_trainer_resumes_under_the_shipped_config_as_if_never_stopped(tmp_path) -> None:
    """configs/nvme.yaml (params.dtype bfloat16): a Trainer that saves at step 2 and a fresh model and context
    resuming from that checkpoint end with the weights of a run never stopped, bit for bit, and the checkpoint's
    weights are the float32 masters (before: the Trainer's own model.load_state_dict() of its resume raised
    "params.dtype is bfloat16 ...", and its saves held bfloat16-rounded weights)."""
    from safetensors.torch import load_file
    from transformers import Trainer

    shipped = str(Path(__file__).resolve().parents[1] / "configs" / "nvme.yaml")

    def run(out: Path, stop_at: int | None) -> dict[str, torch.Tensor]:
        for resume in ((False, True) if stop_at else (False,)):
            torch.manual_seed(0)
            model, opt = model_and_optimizer()
            args = trainer_args(out, save_strategy="steps", save_steps=2, lr_scheduler_type="constant",
                                max_steps=stop_at if stop_at and not resume else 4)  # (a schedule of max_steps)
            trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None))
            with tiered_offload(model, shipped, optimizer=opt, device="cpu", **{
                    "nvme.paths": [str(tmp_path / f"swap-{out.name}-{resume}")], "memory.host_budget": "64MiB"}):
                trainer.train(resume_from_checkpoint=str(out / "checkpoint-2") if resume else None)
        return weights(model)

    whole = run(tmp_path / "whole", None)
    resumed = run(tmp_path / "resumed", 2)
    assert differing(whole, resumed) == []
    saved = load_file(str(tmp_path / "resumed" / "checkpoint-2" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert any(not torch.equal(t, t.bfloat16().float()) for t in saved.values())  # not a bfloat16 rounding
