"""Tasks, tokenizers, models and verifiable rewards for the trainer.

The offline demo: a character tokenizer over digits, '+', '=' and three specials, and a tiny
Llama built from a `transformers` config (nothing downloaded), on "a+b=" → the sum.
Real use: a local Hugging Face checkpoint (`--model`), prompts from a dataset (`--dataset`, data.py) and
rewards given as `exact`, `regex:PATTERN`, `package.module:function` or `path/to/file.py:function`.
"""
from __future__ import annotations

import random
from typing import List, Optional, Tuple

import torch



class CharTokenizer:
    """Digits, '+', '='; pad 0, bos 1, eos 2."""

    chars = "0123456789+="
    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self):
        self.vocab_size = 3 + len(self.chars)
        self._id = {c: i + 3 for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> List[int]:
        """bos + the characters (a prompt)."""
        if not isinstance(text, str):
            raise ValueError("--dataset: conversational prompts need --model (a tokenizer with a chat template); "
                             "the demo's character tokenizer takes plain text")
        bad = set(text) - set(self._id)
        if bad:
            raise ValueError(f"prompt {text!r}: characters {sorted(bad)} are not in the demo vocabulary {self.chars!r}")
        return [self.bos_id] + [self._id[c] for c in text]

    def decode(self, ids) -> str:
        """The characters up to the first eos; other specials dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= 3:
                out.append(self.chars[i - 3])
        return "".join(out)

    def hf(self):
        """The same tokenizer as a `transformers.PreTrainedTokenizerFast` (what the run folder saves): one token
        per character, bos prepended, decoded without spaces."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        specials = ["<pad>", "<s>", "</s>"]  # pad_id, bos_id, eos_id
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + list(self.chars))}, unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", self.bos_id)])
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


class HFTokenizer:
    """A `transformers` tokenizer behind the same three calls."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        if self.eos_id is None:
            raise ValueError("--model: the tokenizer has no eos token")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        self.bos_id = tok.bos_token_id
        self.vocab_size = len(tok)
        self.max_prompt_length = None  # TRL's max_prompt_length: a longer prompt keeps its last tokens

    def encode(self, prompt) -> List[int]:
        ids = self._encode(prompt)
        return ids[-self.max_prompt_length:] if self.max_prompt_length else ids

    def hf(self):
        return self.tok

    def _encode(self, prompt) -> List[int]:
        """A plain prompt with the tokenizer's special tokens, unless it already starts with its BOS (a
        pre-templated prompt); a conversation (a list of {"role", "content"}) through the chat template
        with the assistant's turn opened, whose text holds its own special tokens."""
        if isinstance(prompt, list):
            if not getattr(self.tok, "chat_template", None):
                raise ValueError("--dataset: conversational prompts need a tokenizer with a chat template, and "
                                 "the --model tokenizer has none")
            text = self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return self.tok(text, add_special_tokens=False)["input_ids"]
        bos = self.tok.bos_token
        return self.tok(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))["input_ids"]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)


def addition_task(digits: int, eval_size: int, seed: int) -> Tuple[list, list]:
    """(train, eval) lists of {"prompt", "answer"}; operands zero-padded so prompts have one length.

    The eval prompts are held out: never sampled for training or warm-up."""
    n = 10 ** digits
    pairs = [(a, b) for a in range(n) for b in range(n)]
    random.Random(seed + 12345).shuffle(pairs)
    eval_size = min(eval_size, len(pairs) // 2)
    fmt = lambda a, b: {"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "answer": str(a + b)}  # noqa: E731
    return [fmt(*p) for p in pairs[eval_size:]], [fmt(*p) for p in pairs[:eval_size]]


def tiny_model(tok: CharTokenizer, prompt_len: int, *, n_layer: int, n_embd: int, n_head: int, max_new_tokens: int):
    """A Llama of a few hundred thousand parameters, from a config (no download), with room for prompts of
    `prompt_len` tokens and their completions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=n_embd, intermediate_size=2 * n_embd,
        num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
        max_position_embeddings=prompt_len + max_new_tokens + 8, tie_word_embeddings=False,
        pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
    )
    return LlamaForCausalLM(config)


def load_model(path: str, attn_implementation: Optional[str] = None, chat_template: Optional[str] = None):
    """(model, tokenizer) from a local Hugging Face checkpoint, offline; `attn_implementation` as from_pretrained
    takes it, `chat_template` replacing the tokenizer's (both TRL's / open-r1's recipe keys)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model: cannot load {path!r} as a Hugging Face causal LM ({e})") from None
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32, **extra)
    except (OSError, ValueError, ImportError) as e:
        flag = "--attn-implementation" if extra and "attn" in str(e).lower() else "--model"
        raise ValueError(f"{flag}: cannot load {path!r} as a Hugging Face causal LM ({e})") from None
    if chat_template is not None:
        tok.chat_template = chat_template
    return model, HFTokenizer(tok)


def check_prompt_lengths(tok: HFTokenizer, prompts: list, limit: Optional[int], new_tokens: int,
                         model_config) -> Optional[str]:
    """Prompts and completions within the model's context: a prompt longer than `limit` (--max-prompt-length) is
    cut to its last `limit` tokens (TRL's), and the line saying how many is returned; without a limit, a prompt
    too long for the model is an error."""
    tok.max_prompt_length = limit
    lengths = [len(tok._encode(ex["prompt"])) for ex in prompts]
    cut = sum(n > limit for n in lengths) if limit else 0
    longest = min(max(lengths), limit or max(lengths))
    context = getattr(model_config, "max_position_embeddings", None)
    if context and longest + new_tokens > context:
        raise ValueError(f"--max-new-tokens: the longest prompt{' (after --max-prompt-length)' * bool(limit)}"
                         f" is {longest} tokens, and {longest} + {new_tokens} is more than the "
                         f"{context} positions of the model (max_position_embeddings); give --max-prompt-length "
                         f"(a longer prompt keeps its last tokens) or a smaller --max-new-tokens")
    return (f"{cut} of {len(lengths)} prompts are longer than --max-prompt-length {limit} tokens: they keep their "
            f"last {limit} (as TRL's max_prompt_length)") if cut else None


def answer_ids(tok, answer: str) -> List[int]:
    """Token ids of a supervised target: the answer then eos."""
    if isinstance(tok, CharTokenizer):
        return tok.encode(answer)[1:] + [tok.eos_id]
    return tok.tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_id]


def supervised_batch(tok, examples) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention_mask, labels) for teacher forcing on answer tokens only (-100 elsewhere)."""
    full, lab = [], []
    for ex in examples:
        p, a = tok.encode(ex["prompt"]), answer_ids(tok, str(ex["answer"]))
        full.append(p + a)
        lab.append([-100] * len(p) + a)
    T = max(len(s) for s in full)
    ids = torch.full((len(full), T), tok.pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (s, l) in enumerate(zip(full, lab)):  # right padding: teacher forcing needs no alignment
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        labels[i, : len(l)] = torch.tensor(l)
    return ids, attn, labels
