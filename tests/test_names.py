"""Names (issue 43): a preset's name in any case everywhere, a --model that names nothing says so with the nearest
directory and presets, an adapter directory as --model says what it is, and a CPU run that cannot fit in memory is
refused before it starts."""

import json

import pytest

import zoo
from recipes import pretrain
from recipes.engine import build
from recipes.engine.build import check_memory, resolve_model
from recipes.engine.sections import LoRASection, ModelSection
from zoo.errors import ZooError
from zoo.generate.cli import main as generate_main
from zoo.models.presets import get_preset

TINY = ["--steps", "1", "--warmup", "1", "--seq-len", "64", "--batch-tokens", "128", "--no-progress", "--device", "cpu"]


def test_a_preset_in_any_case_gets_the_lowercase_names_tokenizer_check(tmp_path):
    # was: Qwen3-0.6B skipped the check, built random weights with the bundled tokenizer and was killed for memory
    for name in ("Qwen3-0.6B", "QWEN3-0.6B", "qwen3-0.6b"):
        with pytest.raises(ZooError, match=r"no tokenizer for preset qwen3-0\.6b: .*tokenizer of Qwen/Qwen3-0\.6B"):
            pretrain.main(["--model", name, "--out", str(tmp_path / "o"), *TINY])
    assert resolve_model(ModelSection(name="Debug")).name == "debug"
    assert zoo.load("DEBUG", device="meta").config == get_preset("debug").config


def test_a_model_that_names_nothing_says_no_such_directory_first_with_the_nearest(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "checkpoint").mkdir()
    with pytest.raises(ZooError) as e:
        resolve_model(ModelSection(name=str(tmp_path / "checkpiont")))
    assert str(e.value).startswith(f"--model {tmp_path}/checkpiont: no such directory (did you mean "
                                   f"{tmp_path}/checkpoint?); nor a preset")
    with pytest.raises(ZooError, match=r"^--model qwen3-0\.6: no such directory; nor a preset \(closest: qwen3-0\.6b"):
        resolve_model(ModelSection(name="qwen3-0.6"))
    monkeypatch.chdir(tmp_path)  # ORG/NAME spelled like a path beside a directory: no such directory, then the hub
    (tmp_path / "runs" / "sft").mkdir(parents=True)
    with pytest.raises(ZooError, match=r"^--model runs/stf: no such directory \(did you mean runs/sft\?\); runs/stf "
                                       r"is not in the Hugging Face cache"):
        resolve_model(ModelSection(name="runs/stf"))


def test_an_adapter_as_model_says_it_is_an_adapter_and_what_to_pass(tmp_path, capsys):
    adapter = tmp_path / "run" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-0.6B",
                                                             "peft_type": "LORA"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ZooError) as e:
        pretrain.main(["--model", str(adapter), "--out", str(tmp_path / "o"), *TINY])
    assert str(e.value) == (f"{adapter} is a LoRA adapter (adapter_config.json, no config.json), not a model: pass "
                            "its base model (Qwen/Qwen3-0.6B) as --model; transformers with PEFT loads the adapter "
                            "over its base (PeftModel.from_pretrained)")
    assert generate_main([str(adapter), "--prompt", "hi"]) == 2
    assert "is a LoRA adapter (adapter_config.json, no config.json), not a model: pass its base model " \
           "(Qwen/Qwen3-0.6B) as CKPT" in capsys.readouterr().err
    (tmp_path / "run" / "model").mkdir()
    (tmp_path / "run" / "model" / "config.json").write_text("{}")
    with pytest.raises(ZooError, match=f"the run that wrote it also wrote the merged model {tmp_path}/run/model, "
                                       "which zoo loads"):
        zoo.load(adapter)


def test_a_cpu_run_over_the_memory_available_is_refused_before_it_starts(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    monkeypatch.setattr(build, "MEMINFO", meminfo)
    monkeypatch.delenv("ZOO_IGNORE_MEMORY", raising=False)
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:          100000 kB\nMemAvailable:    8388608 kB\n")
    assert build.available_memory() == 8 * 2**30
    qwen = get_preset("qwen3-0.6b").config  # 0.6 B parameters: 8.9 GiB in fp32 with gradients and AdamW's states
    with pytest.raises(ZooError) as e:
        check_memory(ModelSection(name="qwen3-0.6b"), qwen, 512, None)
    message = str(e.value)
    assert message.startswith("--model qwen3-0.6b needs about 8.9 GiB for its weights, gradients and AdamW states and "
                              "1.0 GiB for activations at --seq-len 512, 9.8 GiB in all, but this machine has 8.0 GiB "
                              "available; use a smaller --seq-len, LoRA (--lora-rank 16) or a smaller model"), message
    check_memory(ModelSection(name="qwen3-0.6b"), qwen, 512, LoRASection(rank=16))  # a frozen base: 2.4 GiB
    check_memory(ModelSection(name="qwen3-0.6b", dtype="bfloat16"), qwen, 512, None)  # half of it in bf16
    monkeypatch.setenv("ZOO_IGNORE_MEMORY", "1")
    check_memory(ModelSection(name="qwen3-0.6b"), qwen, 512, None)
    monkeypatch.delenv("ZOO_IGNORE_MEMORY")
    # through the recipe, on the debug preset, with the memory nearly gone: refused before any step
    meminfo.write_text("MemAvailable:       1024 kB\n")
    with pytest.raises(ZooError, match=r"--model debug needs about .* but this machine has 0\.0 GiB available"):
        pretrain.main(["--out", str(tmp_path / "o"), *TINY])
    assert not (tmp_path / "o").exists()
