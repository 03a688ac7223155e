"""What the recipes choose and say on their own: the learning rate by what is trained, the warmup and --resume
checks, the chat template chosen for a tokenizer without one (and exported with the model), the messages in words."""

import json
import shutil

import pytest

from recipes import dpo, sft
from recipes.data import SFTData
from recipes.data.tokenizer_choice import ASSETS, Tokenizer
from recipes.engine.defaults import PRETRAINED_LR, choose_lr, schedule_warning
from recipes.engine.sections import ModelSection, OptimSection
from zoo.errors import ZooError
from zoo.io.chat import render
from zoo.io.chat_jinja import builtin_jinja, template_choice
from zoo.io.chat_template import render_template


def test_no_usable_samples_in_words(tmp_path):
    f = tmp_path / "chats.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ZooError) as e:
        SFTData(str(f), Tokenizer(ASSETS), 64, 0)
    assert str(e.value) == f"no usable chat samples in {f}: 1 file, 1 sample, 1 without an assistant turn (skipped)"


def smollm2_tokenizer(path):
    """The bundled tokenizer as SmolLM2's base checkpoint configures its own: bos <|im_start|>, eos <|im_end|>, no
    chat template."""
    path.mkdir()
    shutil.copyfile(ASSETS / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell cat."},
        {"role": "assistant", "content": "C-A-T."}]


def test_sft_names_its_template_and_exports_it(tmp_path, capsys):
    """A tokenizer without a chat template: SFT says which one it chose and why, renders no doubled start token,
    and OUT/model and OUT/model-hf carry the template, so transformers renders what the model was trained on."""
    from transformers import AutoTokenizer

    d = smollm2_tokenizer(tmp_path / "smollm2")
    tok = Tokenizer(d)
    trained = render(CHAT, "auto", tok).text
    assert trained.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "<|im_start|><|im_start|>" not in trained
    out = tmp_path / "sft"
    sft.main(["--model", "debug", "--tokenizer", str(d), "--steps", "1", "--out", str(out), "--export-hf",
              "--seq-len", "64", "--batch-tokens", "64", "--no-progress", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert ("chat template: internlm2 (built-in ChatML: the tokenizer has no chat template of its own, and has "
            "<|im_start|>); --chat-template to choose") in printed
    assert "lr 0.001 (training a model from scratch; --lr to change)\n" in printed
    assert printed.count("warning: --warmup 5 is at least --steps 1") == 1, printed
    for exported in (out / "model", out / "model-hf"):
        assert (exported / "chat_template.jinja").is_file()
        hf = AutoTokenizer.from_pretrained(str(exported))
        assert hf.apply_chat_template(CHAT, tokenize=False) == trained
        assert hf.apply_chat_template(CHAT[:-1], tokenize=False, add_generation_prompt=True) == render(
            CHAT[:-1], "internlm2", tok, add_generation_prompt=True).text
        again = Tokenizer(exported)  # and zoo, reading the export, renders it with the same template
        assert template_choice(again).startswith("checkpoint") and render(CHAT, "auto", again).text == trained


@pytest.mark.parametrize("name", ["internlm2", "llama-2", "llama-3"])
def test_builtin_jinja_renders_as_the_builtin(name):
    tok = Tokenizer(ASSETS)
    chats = [CHAT, [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "hello "},
                    {"role": "user", "content": "again"}, {"role": "assistant", "content": "yes"}]]
    for chat in chats:
        jinja = render_jinja_text(builtin_jinja(name, tok), tok, chat)
        assert jinja == render(chat, name, tok).text


def render_jinja_text(template, tok, chat):
    return render_template(template, None, {**tok.template_tokens(), "messages": chat, "add_generation_prompt": False})


@pytest.mark.parametrize(("model", "lora", "preference", "lr", "why"), [
    ("ckpt", False, False, 2e-5, "full fine-tuning from a checkpoint"),
    ("ckpt", True, False, 2e-4, "LoRA"),
    ("debug", True, False, 2e-4, "LoRA"),
    ("debug", False, False, 1e-3, "training a model from scratch"),
    ("toy", False, False, 1e-3, "a checkpoint of 1.3M parameters, a toy's size"),
    ("ckpt", False, True, 1e-6, "full preference tuning from a checkpoint"),
    ("ckpt", True, True, 5e-5, "LoRA preference tuning"),
    ("debug", False, True, 1e-3, "preference tuning a model from scratch"),
])
def test_lr_by_what_is_trained(tmp_path, monkeypatch, model, lora, preference, lr, why):
    """The rate of what is trained; a checkpoint counts as pretrained from TINY parameters up (the debug model, 1.3M,
    stands in for a real one here with TINY lowered)."""
    import zoo
    from recipes.engine import defaults

    ckpt = zoo.save(zoo.load("debug"), tmp_path / "ckpt")
    if model == "ckpt":
        monkeypatch.setattr(defaults, "TINY", 1_000_000)
    optim = OptimSection(lr=0.0)
    line = choose_lr(optim, ModelSection(name=str(ckpt) if model != "debug" else "debug"), lora, preference, 1e-3)
    assert optim.lr == lr and line == f"lr {lr:g} ({why}; --lr to change)"
    given = OptimSection(lr=3e-4)  # the user's --lr always wins
    assert choose_lr(given, ModelSection(name=str(ckpt)), lora, preference, 1e-3) == "lr 0.0003" and given.lr == 3e-4


def test_warmup_as_long_as_the_run_is_one_warning():
    assert schedule_warning(OptimSection(warmup=5), 6) is None
    assert "reaches --lr only at the last step" in schedule_warning(OptimSection(warmup=5), 5)
    assert "never reaches --lr (its last step runs at 50% of it)" in schedule_warning(OptimSection(warmup=10), 5)


def test_lora_dpo_default_moves_the_loss(tmp_path, capsys):
    """LoRA DPO at its defaults leaves ln 2 within three steps (B starts at zero, so step 1 is exactly ln 2); at the
    old default, 5e-6, the loss printed 0.6931 for five steps."""
    import torch
    from test_dpo import write_pairs

    import zoo

    torch.manual_seed(0)
    zoo.save(zoo.load("debug"), tmp_path / "base", tokenizer_from=str(ASSETS))
    data = write_pairs(tmp_path / "pairs.jsonl", n=16)
    args = ["--model", str(tmp_path / "base"), "--data", str(data), "--seq-len", "64", "--batch-tokens", "896",
            "--no-progress", "--save-every", "0", "--steps", "3", "--device", "cpu", "--lora-rank", "8"]
    losses = dpo.main([*args, "--out", str(tmp_path / "o")])
    assert "lr 5e-05 (LoRA preference tuning; --lr to change)" in capsys.readouterr().out
    assert PRETRAINED_LR[True, True][0] == 5e-05
    assert abs(losses[0] - 0.693147) < 1e-5 and f"{losses[2]:.4f}" != "0.6931" and losses[2] < losses[0]
    old = dpo.main([*args, "--out", str(tmp_path / "old"), "--lr", "5e-6"])
    assert all(f"{x:.4f}" == "0.6931" for x in old)


def test_resume_with_other_steps_follows_the_new_schedule(tmp_path, capsys):
    """--resume with a different --steps says so, and every step from there has the new schedule's rate (the
    first resumed step used to keep the rate the checkpoint's run computed for its own --steps)."""
    from recipes import pretrain

    args = ["--device", "cpu", "--seq-len", "64", "--batch-tokens", "64", "--no-progress", "--warmup", "2",
            "--save-every", "4"]
    pretrain.main([*args, "--steps", "12", "--out", str(tmp_path / "whole")])
    pretrain.main([*args, "--steps", "6", "--out", str(tmp_path / "cut")])
    capsys.readouterr()
    pretrain.main([*args, "--steps", "12", "--out", str(tmp_path / "cut"), "--resume"])
    printed = capsys.readouterr().out
    assert ("--resume: --steps 6 -> 12: the learning-rate schedule (warmup 2, then cosine decay) now ends at step 12, "
            "and steps 7 on follow it") in printed

    def lrs(out):
        return [json.loads(line)["lr"] for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    assert len(lrs("cut")) == 12 and lrs("cut")[6:] == lrs("whole")[6:]


def test_step_line_shows_rewards_and_the_expert_load():
    from recipes.engine.metrics import step_extras

    row = {"rewards/chosen": 0.0123, "rewards/rejected": -0.02, "rewards/accuracies": 0.75,
           "rewards/margins": 0.0323, "logps/chosen": -50.0}
    assert step_extras(row) == ("  rewards/chosen 0.0123  rewards/rejected -0.0200  rewards/accuracies 0.7500  "
                                "rewards/margins 0.0323")
    row = {"aux_loss": 1.0312, "expert_load_min": 0.0, "expert_load_max": 2.5}
    assert step_extras(row) == "  aux_loss 1.0312  expert load 0.00-2.50"
    assert step_extras({"loss": 1.0}) == ""


def test_an_expert_without_tokens_for_many_steps_is_counted():
    """end_step counts, per layer and expert, the steps in a row without a token; from COLLAPSED_AFTER on such an
    expert is in experts_idle (and the run warns once, recipes.metrics)."""
    import torch

    from recipes.engine.moe import COLLAPSED_AFTER, Balance

    balance = Balance(0.01, "batch", 0.0)
    idle = []
    for step in range(COLLAPSED_AFTER + 3):
        counts = torch.tensor([[0, 5, 5, 6], [4, 4, 4 if step != 3 else 0, 4]])  # expert 2 of layer 1 idles once
        balance.sums = {"aux_loss": torch.tensor(1.0), "z_loss": torch.tensor(0.0), "expert_counts": counts}
        idle.append(balance.end_step()["experts_idle"])
    assert idle == [0] * (COLLAPSED_AFTER - 1) + [1] * 4


def test_router_collapse_is_one_warning(tmp_path, capsys):
    from recipes.engine.metrics import Metrics
    from recipes.engine.processes import Dist
    from recipes.engine.sections import LogSection, RunSection
    from recipes.pretrain import PretrainConfig

    cfg = PretrainConfig(run=RunSection(out=str(tmp_path / "o"), steps=4), log=LogSection(progress=False))
    metrics = Metrics(cfg, Dist(), 0)
    for step, idle in enumerate([0, 1, 2, 2], 1):
        metrics.log({"step": step, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 10.0, "tflops": 0.0, "mfu": None,
                     "grad_norm": 1.0, "aux_loss": 1.5, "expert_load_min": 0.0, "expert_load_max": 2.0,
                     "experts_idle": idle})
    metrics.close()
    printed = capsys.readouterr().out
    assert printed.count("warning:") == 1 and "warning: step 2: 1 expert received no token for 20 steps" in printed
    assert "aux_loss 1.5000  expert load 0.00-2.00" in printed.splitlines()[0]


@pytest.mark.parametrize("recipe", ["pretrain", "sft", "dpo"])
def test_a_full_out_is_refused_before_model_and_data_load(tmp_path, monkeypatch, recipe):
    """The --out check comes first: here the data would fail to load (and the model to build), but the error is
    --out's."""
    import importlib

    module = importlib.import_module(f"recipes.{recipe}")

    def never(*args, **kwargs):
        raise AssertionError("loaded before --out was checked")

    monkeypatch.setattr(module, "build_model", never)
    monkeypatch.setattr(module, "find_tokenizer", never)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ZooError, match=r"--out .* is not empty \(it holds notes.txt\)"):
        module.main(["--out", str(out), "--data", str(tmp_path / "missing.jsonl"), "--device", "cpu"])
    assert (out / "notes.txt").read_text() == "mine"


PRETRAIN = ["--device", "cpu", "--seq-len", "64", "--batch-tokens", "64", "--no-progress", "--steps", "2",
            "--save-every", "0"]


def test_tensorboard_refused_without_the_package(tmp_path, monkeypatch):
    import sys

    from recipes import pretrain

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import raises ImportError
    with pytest.raises(ZooError, match=r"--tensorboard .* pip install 'zoo\[tensorboard\]'") as e:
        pretrain.main([*PRETRAIN, "--out", str(tmp_path / "run"), "--tensorboard"])
    assert "\n" not in str(e.value)


def test_tensorboard_gets_the_scalars_only_when_asked(tmp_path, monkeypatch):
    import sys
    import types

    from recipes import pretrain

    written = []

    class Writer:
        def __init__(self, logdir):
            written.append(("dir", logdir))

        def add_scalar(self, name, value, step):
            written.append((name, step))

        def close(self):
            written.append(("closed", None))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    pretrain.main([*PRETRAIN, "--out", str(tmp_path / "plain")])
    assert written == []
    pretrain.main([*PRETRAIN, "--out", str(tmp_path / "tb"), "--tensorboard"])
    assert written[0] == ("dir", str(tmp_path / "tb" / "tensorboard")) and written[-1] == ("closed", None)
    assert ("train/loss", 1) in written and ("train/lr", 2) in written
