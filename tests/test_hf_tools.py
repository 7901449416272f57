"""HuggingFace tools on converted tiny models: Trainer with resume_from_checkpoint, pipeline("text-generation")."""

from __future__ import annotations

import pytest
import torch
from test_families import VOCAB, family_model, token_ids
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments, pipeline

from mhc import MHCBlock, convert_to_mhc


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, rows: int = 8, seq: int = 10):
        self.ids = token_ids(rows, seq, seed=7)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer(model, out_dir) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    return Trainer(model=model, args=args, train_dataset=RandomTokens())


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_trainer_resume_from_checkpoint_matches_an_uninterrupted_run(family, tmp_path):
    """4 steps straight equal 2 steps, a checkpoint, and 2 resumed steps on a fresh model (mHC coefficients included)."""
    straight = convert_to_mhc(family_model(family), n_streams=4)
    init = {n: p.detach().clone() for n, p in straight.named_parameters()}
    trainer(straight, tmp_path / "a").train()
    assert (tmp_path / "a" / "checkpoint-2").is_dir()
    moved = [n for n, p in straight.named_parameters() if "_mhc." in n and not torch.equal(p, init[n])]
    assert any(n.endswith(".phi") for n in moved)

    resumed = convert_to_mhc(family_model(family), n_streams=4)
    trainer(resumed, tmp_path / "b").train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    final = dict(resumed.named_parameters())
    for name, p in straight.named_parameters():
        torch.testing.assert_close(final[name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(final[moved[0]], init[moved[0]])


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB tokens "<pad> <s> </s> w3 ... w95" (ids as in the tiny configs)."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi"])
def test_text_generation_pipeline(family):
    """pipeline("text-generation") on a converted model writes what the original model writes (default init)."""
    tok = word_tokenizer()
    prompt = "w5 w17 w42 w8"
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_full_text=False)
    original = pipeline("text-generation", model=family_model(family), tokenizer=tok, device="cpu")(
        prompt, **kw
    )
    model = convert_to_mhc(family_model(family), n_streams=4)
    generated = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")(prompt, **kw)
    text = generated[0]["generated_text"]
    assert text.strip() and text == original[0]["generated_text"]
    # and it runs the mHC blocks: moved coefficients change what is written
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MHCBlock):
                m.b_post.add_(torch.linspace(-2, 2, m.n_streams))
    ids = tok(prompt, return_tensors="pt").input_ids
    direct = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
    )
    again = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")(prompt, **kw)[0][
        "generated_text"
    ]
    assert again == tok.decode(direct[0, ids.shape[1] :], skip_special_tokens=True)
