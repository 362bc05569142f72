#!/usr/bin/env python3
"""Generate ares-model's tokenizer and chat-template fixtures (deterministic, offline).

Writes under ares-model/tests/fixtures/tokenizer/:

  qwen_style/   tokenizer.json (a small byte-level BPE with Qwen2's pipeline),
                tokenizer_config.json with the chat template inline (a string)
  llama_style/  tokenizer.json (same model, plus a BOS-adding post-processor like Llama 3),
                tokenizer_config.json (with a decoy inline template) + chat_template.jinja,
                which transformers prefers over the inline one
  named/        tokenizer_config.json with HF's list of named templates
                ("default" and "tool_use")
  qwen3/        Qwen3's real chat template (templates/qwen3_0.6b.jinja, below) inline in a
                tokenizer_config.json as Qwen3's, over qwen_style's BPE with Qwen3's added
                tokens <think>, </think>, <tool_call>, </tool_call>, <tool_response>,
                </tool_response> (not special, as in Qwen3's file); its cases carry the
                ids transformers encodes the rendered prompt to
  golden.json            ids from HF `tokenizers` for ~100 strings, per tokenizer
  expected_chats.json    prompts rendered by transformers' apply_chat_template

The templates in templates/ are written for these tests (not copied from any model), but
qwen3_0.6b.jinja: the chat template of Qwen/Qwen3-0.6B (Apache-2.0, the `chat_template` of its
tokenizer_config.json, as llama.cpp keeps it in models/templates/Qwen-Qwen3-0.6B.jinja), verbatim
with LF line ends.

Run with a Python that has `tokenizers` and `transformers`:
    python scripts/make_tokenizer_fixtures.py
(made with transformers 5.24.0 and tokenizers 0.23.3).
"""

import datetime as _dt
import json
import os
import shutil
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import chat_template_utils

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ares-model", "tests", "fixtures", "tokenizer")
TEMPLATES = os.path.join(ROOT, "templates")

# Qwen2's pre-tokenizer regex (from its tokenizer.json): contractions, letters, single digits,
# punctuation runs, newlines, trailing-space lookahead.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Qwen3's added tokens that are not special (its tokenizer_config.json: "special": false).
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
VOCAB_SIZE = 400

# strftime_now is datetime.now(); the fixtures pin it to this moment.
FIXED_NOW = _dt.datetime(2024, 7, 6, 9, 5, 3)


def training_text():
    """A few hundred lines of mixed text, generated deterministically."""
    words = [
        "the", "model", "reward", "policy", "token", "answer", "question", "gradient", "step",
        "learning", "rate", "batch", "sample", "entropy", "value", "assistant", "user", "system",
        "function", "call", "weather", "city", "Paris", "Berlin", "München", "café", "naïve",
        "日本語", "中文", "测试", "ok", "don't", "it's", "we're", "I'll", "they've", "I'd", "I'm",
    ]
    lines = []
    for i in range(400):
        w = [words[(i * 7 + k * 11) % len(words)] for k in range(6 + i % 5)]
        line = " ".join(w)
        if i % 3 == 0:
            line += f" {i * 37 % 1000}.{i % 10}"
        if i % 5 == 0:
            line = line.capitalize() + "!"
        if i % 7 == 0:
            line = "    " + line + "  \t"
        if i % 11 == 0:
            line += " 🙂 é ü ß"
        if i % 13 == 0:
            line = f"def f_{i}(x):\n    return x * {i}\n"
        lines.append(line)
    return lines


def build_tokenizer(with_bos):
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=QWEN_SPECIALS + LLAMA_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    if with_bos:
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
                ),
            ]
        )
    else:
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def golden_strings():
    s = [
        "",
        " ",
        "  ",
        "\n",
        "\n\n\n",
        "\t",
        " \t \n ",
        "hello",
        "Hello world",
        "Hello  world",
        "Hello   world   ",
        "hello\nworld",
        "hello\r\nworld",
        "line one\n\n  line two\n",
        "trailing spaces   ",
        "   leading spaces",
        "don't",
        "DON'T",
        "it's they've we're I'll I'd I'm",
        "IT'S THEY'VE WE'RE I'LL I'D I'M",
        "'s 'S 't 're 've 'm 'll 'd",
        "rock'n'roll",
        "0",
        "12345",
        "3.14159",
        "1,000,000",
        "x=42; y=-7",
        "2024-07-06T09:05:03Z",
        "version 1.2.3-rc4",
        "Ⅻ ½ ² ٣ ४",
        "café",
        "cafe\u0301",
        "naïve résumé",
        "München Straße",
        "Ελληνικά κείμενο",
        "Русский текст",
        "日本語のテキスト",
        "中文测试",
        "한국어",
        "עברית",
        "العربية",
        "🙂",
        "🙂🙂 🙃",
        "👩‍👩‍👧‍👦 family",
        "e\u0301\u0302",
        "ﬁ ligature",
        "Ｆｕｌｌｗｉｄｔｈ",
        "tabs\tand\tmore\t\ttabs",
        "!!!???...",
        "a.b,c;d:e",
        "(parentheses) [brackets] {braces}",
        "<html><body>x</body></html>",
        "path/to/file.txt",
        "https://example.com/a?b=c&d=e",
        "user@example.com",
        "$100 & 50%",
        "#hashtag @mention",
        "def f(x):\n    return x * 2\n",
        "    indented\n        more\n",
        "if (a && b) { return; }",
        "`code` **bold** _it_",
        "\"quoted\" 'single'",
        "\\backslash\\",
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|im_start|>user\nHi<|im_end|>\n",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "text<|endoftext|>more",
        "<|im_start|><|im_end|>",
        "<|im_start |>",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
        "<|eot_id|>",
        "a<|eot_id|>b",
        "the model",
        "The Model",
        "THE MODEL",
        "reward policy gradient",
        "learning rate batch sample",
        "assistant user system",
        "weather in Paris",
        "Berlin and München",
        "entropy value step",
        " the",
        "the ",
        "  the  ",
        "\u00a0non-breaking\u00a0space",
        "zero\u200bwidth",
        "control\u0007bell",
        "mixed 日本 and English 123",
        "x" * 50,
        "ab" * 30,
        "1" * 20,
        " " * 17,
        "\n" * 5 + "end",
        "end" + " " * 5,
        "a\n b\n  c\n   d",
        "Question: what is 7*6?\nAnswer: 42",
        "<think>\nreasoning\n</think>\n\nanswer",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>",
    ]
    return s


def golden(tok, strings):
    out = []
    for text in strings:
        plain = tok.encode(text, add_special_tokens=False).ids
        special = tok.encode(text, add_special_tokens=True).ids
        out.append(
            {
                "text": text,
                "ids": plain,
                "ids_with_special": special,
                "decoded": tok.decode(plain, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(plain, skip_special_tokens=True),
            }
        )
    return out


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def write_json_compact_ids(path, obj):
    """write_json, indented, with each list of integers on one line (the qwen3 cases' ids)."""
    import re

    text = json.dumps(obj, ensure_ascii=False, indent=2)
    text = re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def write_json(path, obj, indent=2):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=indent)
        f.write("\n")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city — «quoted» & <escaped>?",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. München"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "noop", "description": "Does nothing.", "parameters": {"type": "object", "properties": {}}},
    },
]

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2+2?"}],
    "system_user": [
        {"role": "system", "content": "  You grade answers strictly.  "},
        {"role": "user", "content": "Solve: x + 3 = 5"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a prime — in 日本語 too."},
        {"role": "assistant", "content": "<think>\n7 is prime.\n</think>\n\nSeven (七)."},
        {"role": "user", "content": "  And another?  "},
    ],
    "tool_round": [
        {"role": "user", "content": "Weather in Paris and Berlin?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
            ],
        },
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"temp\": 18}"},
        {"role": "assistant", "content": "Paris 21°C, Berlin 18°C."},
        {"role": "user", "content": "Thanks"},
    ],
}


# Qwen3's own cases: thinking in `reasoning_content` and in the content, a multi-step tool use
# (reasoning, a call, its answer, a final answer), and the query after a tool round.
QWEN3_CONVERSATIONS = {
    "reasoning_field": [
        {"role": "user", "content": "What is 3*4?"},
        {"role": "assistant", "content": "12", "reasoning_content": "\n3 times 4 is 12.\n"},
        {"role": "user", "content": "And 5*6?"},
        {"role": "assistant", "content": "\n30", "reasoning_content": "5 times 6."},
    ],
    "multi_step_tool": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "<think>\nI should call the tool.\n</think>\n\nLet me check.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"type": "function", "function": {"name": "noop", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "<think>\nIt is 21.\n</think>\n\nIt is 21°C in Paris."},
    ],
}


def render(tokenizer, messages, tools, add_generation_prompt, **kwargs):
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def qwen3_fixture():
    """Writes qwen3/ and returns its chat cases."""
    shutil.rmtree(os.path.join(ROOT, "qwen3"), ignore_errors=True)
    os.makedirs(os.path.join(ROOT, "qwen3"))
    # Qwen3: its real template, its added tokens, its special-token settings.
    qwen3_tok = build_tokenizer(with_bos=False)
    qwen3_tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
    qwen3_tok.save(os.path.join(ROOT, "qwen3", "tokenizer.json"))
    write_json(
        os.path.join(ROOT, "qwen3", "tokenizer_config.json"),
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": read(os.path.join(TEMPLATES, "qwen3_0.6b.jinja")),
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    cases = []
    # Qwen3's real template: every conversation with and without tools, with and without a
    # generation prompt, enable_thinking unset / false / true; the ids of each prompt.
    hf = AutoTokenizer.from_pretrained(os.path.join(ROOT, "qwen3"))
    conversations = dict(CONVERSATIONS, **QWEN3_CONVERSATIONS)
    for name, messages in conversations.items():
        for tools in [None, TOOLS]:
            for agp in [False, True]:
                for extra in [{}, {"enable_thinking": False}, {"enable_thinking": True}]:
                    if extra and not agp:
                        continue  # the switch only acts on the generation prompt
                    text = render(hf, messages, tools, agp, **extra)
                    case = {
                        "model_dir": "qwen3",
                        "tools": tools is not None,
                        "add_generation_prompt": agp,
                        "extra": extra,
                        "expected": text,
                        "expected_ids": hf(text, add_special_tokens=False)["input_ids"],
                    }
                    if name in QWEN3_CONVERSATIONS:
                        case["messages"] = messages
                    else:
                        case["conversation"] = name
                    cases.append(case)
    return cases


def main():
    # Deterministic strftime_now.
    class FixedDatetime(_dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return FIXED_NOW

    chat_template_utils.datetime = FixedDatetime

    for d in ["qwen_style", "llama_style", "named"]:
        shutil.rmtree(os.path.join(ROOT, d), ignore_errors=True)
        os.makedirs(os.path.join(ROOT, d))

    qwen25 = read(os.path.join(TEMPLATES, "qwen25_like.jinja"))
    qwen3 = read(os.path.join(TEMPLATES, "qwen3_like.jinja"))
    llama3 = read(os.path.join(TEMPLATES, "llama3_like.jinja"))
    quirks = read(os.path.join(TEMPLATES, "quirks.jinja"))

    qwen_tok = build_tokenizer(with_bos=False)
    llama_tok = build_tokenizer(with_bos=True)
    qwen_tok.save(os.path.join(ROOT, "qwen_style", "tokenizer.json"))
    llama_tok.save(os.path.join(ROOT, "llama_style", "tokenizer.json"))

    # Qwen2.5-Instruct style: template inline, eos im_end, pad endoftext, no bos.
    write_json(
        os.path.join(ROOT, "qwen_style", "tokenizer_config.json"),
        {
            "add_prefix_space": False,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": qwen25,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 32768,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        },
    )
    # Llama 3 style: bos/eos as AddedToken dicts (older files), template in chat_template.jinja;
    # the inline template is a decoy that transformers ignores in favour of the file.
    write_json(
        os.path.join(ROOT, "llama_style", "tokenizer_config.json"),
        {
            "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False,
                          "normalized": False, "rstrip": False, "single_word": False, "special": True},
            "chat_template": "DECOY: chat_template.jinja must win",
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>",
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    with open(os.path.join(ROOT, "llama_style", "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(llama3)
    # Named templates (HF list form): default + tool_use.
    write_json(
        os.path.join(ROOT, "named", "tokenizer_config.json"),
        {
            "chat_template": [{"name": "default", "template": qwen3}, {"name": "tool_use", "template": qwen25}],
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    shutil.copy(os.path.join(ROOT, "qwen_style", "tokenizer.json"), os.path.join(ROOT, "named", "tokenizer.json"))

    strings = golden_strings()
    gold = {"qwen_style": golden(qwen_tok, strings), "llama_style": golden(llama_tok, strings)}
    # transformers must agree with tokenizers (it wraps it); its decode also applies
    # clean_up_tokenization_spaces from tokenizer_config.json (true for llama_style).
    for d in ["qwen_style", "llama_style"]:
        hf = PreTrainedTokenizerFast.from_pretrained(os.path.join(ROOT, d))
        for g in gold[d]:
            assert hf.encode(g["text"], add_special_tokens=False) == g["ids"], (d, g["text"])
            assert hf.encode(g["text"], add_special_tokens=True) == g["ids_with_special"], (d, g["text"])
            g["transformers_decoded"] = hf.decode(g["ids"], skip_special_tokens=False)
            g["transformers_decoded_skip_special"] = hf.decode(g["ids"], skip_special_tokens=True)
    gold["vocab_size"] = qwen_tok.get_vocab_size(with_added_tokens=True)
    gold["vocab_size_base"] = qwen_tok.get_vocab_size(with_added_tokens=False)
    gold["special_ids"] = {t: qwen_tok.token_to_id(t) for t in QWEN_SPECIALS + LLAMA_SPECIALS}
    write_json(os.path.join(ROOT, "golden.json"), gold, indent=None)

    cases = []
    for d in ["qwen_style", "llama_style", "named"]:
        hf = PreTrainedTokenizerFast.from_pretrained(os.path.join(ROOT, d))
        for name, messages in CONVERSATIONS.items():
            for tools in [None, TOOLS]:
                for agp in [False, True]:
                    if d == "llama_style" and name == "tool_round" and tools is None:
                        continue  # not meaningful without tools; still rendered with tools
                    extra = {}
                    if d == "named" and name == "user_only" and agp:
                        extra = {"enable_thinking": False}
                    text = render(hf, messages, tools, agp, **extra)
                    cases.append(
                        {
                            "model_dir": d,
                            "conversation": name,
                            "tools": tools is not None,
                            "add_generation_prompt": agp,
                            "extra": extra,
                            "expected": text,
                        }
                    )
    cases += qwen3_fixture()
    # Python-flavoured output through a bare template with Qwen's special tokens.
    hf = PreTrainedTokenizerFast.from_pretrained(os.path.join(ROOT, "qwen_style"))
    quirk_messages = [
        {"role": "user", "content": "  Hi there, how are you?  ",
         "meta": {"flag": True, "ratio": 0.25, "count": 10, "none": None, "name": "Zoë «x»",
                  "list": [1, 2.5, "三", False, None], "nested": {"b": 1, "a": [{}, []]}}},
        {"role": "assistant", "content": "Fine."},
    ]
    for agp in [False, True]:
        cases.append(
            {
                "template_file": "quirks.jinja",
                "model_dir": "qwen_style",
                "messages": quirk_messages,
                "tools": False,
                "add_generation_prompt": agp,
                "extra": {},
                "expected": hf.apply_chat_template(
                    quirk_messages, chat_template=quirks, tokenize=False, add_generation_prompt=agp
                ),
            }
        )
    write_json_compact_ids(
        os.path.join(ROOT, "expected_chats.json"),
        {
            "now": FIXED_NOW.isoformat(),
            "tools": TOOLS,
            "conversations": CONVERSATIONS,
            "cases": cases,
        },
    )
    print(f"wrote {len(strings)} golden strings and {len(cases)} chat cases to {ROOT}", file=sys.stderr)


if __name__ == "__main__":
    main()
