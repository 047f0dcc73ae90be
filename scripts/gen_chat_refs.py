#!/usr/bin/env python3
"""Renders diskformer's chat-template test scenarios with HF transformers (the reference) and writes
crates/tokenizer/testdata/chat/refs.json, which crates/tokenizer/tests/chat_templates.rs checks.

Usage: python3 scripts/gen_chat_refs.py   (needs `pip install transformers jinja2`; made with
transformers 5.24.0, jinja2 3.1.6). Templates live in crates/tokenizer/testdata/chat/*.jinja;
smollm2.jinja is `tokenizer.chat_template` of SmolLM2-135M-Instruct.Q4_1.gguf (scripts/get-models.sh).
"""
import json
from pathlib import Path

import jinja2
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

CHAT = Path(__file__).resolve().parent.parent / "crates/tokenizer/testdata/chat"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — in °C or °F",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7, "default": 1},
            },
            "required": ["city"],
        },
    },
}
SUM_TOOL = {
    "type": "function",
    "function": {
        "name": "sum",
        "description": "Adds numbers <exactly> & \"safely\"",
        "parameters": {
            "type": "object",
            "properties": {"xs": {"type": "array", "items": {"type": "number"}}, "strict": {"type": "boolean"}},
            "required": [],
        },
    },
}

SCENARIOS = [
    {
        "name": "smollm2_single_user_generation_prompt",
        "template": "smollm2.jinja",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "add_generation_prompt": True,
    },
    {
        "name": "smollm2_multi_turn_with_system",
        "template": "smollm2.jinja",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello. ✓"},
            {"role": "user", "content": "Bye\n"},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "gemma_system_folded_and_trimmed",
        "template": "gemma_style.jinja",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "  Name a colour.  "},
            {"role": "assistant", "content": "Blue.\n"},
            {"role": "user", "content": "Another?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "gemma_content_parts",
        "template": "gemma_style.jinja",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look: "},
                    {"type": "image"},
                    {"type": "text", "text": " what is it? "},
                ],
            }
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "gemma_rejects_two_user_turns",
        "template": "gemma_style.jinja",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        "add_generation_prompt": True,
    },
    {
        "name": "tools_call_and_responses",
        "template": "tools_thinking.jinja",
        "bos_token": "",
        "eos_token": "<|im_end|>",
        "tools": [WEATHER_TOOL, SUM_TOOL],
        "messages": [
            {"role": "system", "content": "  You help with weather.\n"},
            {"role": "user", "content": "Weather in Zürich and Paris, and 1.5+2?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                    {"type": "function", "function": {"name": "sum", "arguments": {"xs": [1.5, 2, 1e-05, 1e16], "strict": True, "note": None}}},
                ],
            },
            {"role": "tool", "tool_call_id": "a", "name": "get_weather", "content": "{\"temp\": 21}"},
            {"role": "tool", "tool_call_id": "b", "name": "get_weather", "content": "rain"},
            {"role": "tool", "tool_call_id": "c", "name": "sum", "content": "3.5"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "thinking_disabled",
        "template": "tools_thinking.jinja",
        "bos_token": "",
        "eos_token": "<|im_end|>",
        "messages": [{"role": "user", "content": "Quick: capital of France?"}],
        "add_generation_prompt": True,
        "enable_thinking": False,
    },
    {
        "name": "thinking_history",
        "template": "tools_thinking.jinja",
        "bos_token": "",
        "eos_token": "<|im_end|>",
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nsimple sum\n</think>\n\n4"},
            {"role": "user", "content": "times 3?"},
            {"role": "assistant", "content": "12", "reasoning_content": "\n4*3 = 12\n"},
        ],
        "add_generation_prompt": False,
        "enable_thinking": True,
    },
    {
        "name": "unknown_role_raises",
        "template": "tools_thinking.jinja",
        "bos_token": "",
        "eos_token": "<|im_end|>",
        "messages": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "..."}],
        "add_generation_prompt": False,
    },
    {
        "name": "tojson_options",
        "template": "tojson_options.jinja",
        "bos_token": "",
        "eos_token": "",
        "messages": [{"role": "user", "content": "x"}],
        "add_generation_prompt": False,
        "extra": {"payload": {"b": [1, 2.5, None, True], "a": "é<>&'\"\n\t\u0001", "c": {}, "d": []}},
    },
]


def main():
    refs = []
    for s in SCENARIOS:
        template = (CHAT / s["template"]).read_text()
        kwargs = {"bos_token": s["bos_token"], "eos_token": s["eos_token"], **s.get("extra", {})}
        if "enable_thinking" in s:
            kwargs["enable_thinking"] = s["enable_thinking"]
        ref = dict(s)
        try:
            rendered, _generation_indices = render_jinja_template(
                conversations=[s["messages"]],
                tools=s.get("tools"),
                chat_template=template,
                add_generation_prompt=s["add_generation_prompt"],
                **kwargs,
            )
            ref["expected"] = rendered[0]
        except jinja2.exceptions.TemplateError as e:
            ref["expected_error"] = str(e)
        refs.append(ref)
    out = {
        "generator": "scripts/gen_chat_refs.py",
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "scenarios": refs,
    }
    (CHAT / "refs.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(refs)} scenarios to {CHAT / 'refs.json'}")


if __name__ == "__main__":
    main()
