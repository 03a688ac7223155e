"""What the recipes choose and say on their own: the learning rate by what is trained, the warmup and --resume
checks, the chat template chosen for a tokenizer without one (and exported with the model), the messages in words."""

import json

import pytest

from recipes.data import SFTData
from recipes.data.tokenizer_choice import ASSETS, Tokenizer
from zoo.errors import ZooError


def test_no_usable_samples_in_words(tmp_path):
    f = tmp_path / "chats.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ZooError) as e:
        SFTData(str(f), Tokenizer(ASSETS), 64, 0)
    assert str(e.value) == f"no usable chat samples in {f}: 1 file, 1 sample, 1 without an assistant turn (skipped)"
