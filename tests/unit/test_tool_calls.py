"""Tool calling as people write it: the Hermes/Qwen parser, `tools=` in every prompt render (both
context modes), the tool-aware template of the tiny tokenizers, and `model.chat_template`."""

import asyncio
import json

import pytest
from config_fakes import FakeProbes
from helpers import tiny_lm
from transformers import AutoTokenizer

from megatron_stepwise.config import config_from_dict
from megatron_stepwise.config.errors import ConfigError
from megatron_stepwise.envs.tool_calls import (
    ToolCall,
    ToolCallError,
    check_tools,
    function_tool,
    parse_tool_calls,
    tool_message,
    tool_names,
)
from megatron_stepwise.hf.chat_templates import ChatTemplateSourceError, read_chat_template
from megatron_stepwise.hf.tokenizers import CHAR_CHAT_TEMPLATE, load_tokenizer, tokenizer_dir
from megatron_stepwise.rollout.agent.loop import AgentLoop, AgentLoopConfig
from megatron_stepwise.rollout.engines.protocol import GenerateResult, SamplingParams
from megatron_stepwise.steps import TrajectoryID

ADD = function_tool(
    "add",
    "Add two integers.",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)
NOTE = {"name": "note", "description": "Take a note.", "parameters": {"type": "object", "properties": {}}}  # flat shape


def block(obj):
    return f"<tool_call>\n{obj if isinstance(obj, str) else json.dumps(obj)}\n</tool_call>"


# ---- the parser ------------------------------------------------------------------------------


def test_parses_one_or_several_calls_in_order_with_the_text_around_them():
    text = (
        "Let me add. "
        + block({"name": "add", "arguments": {"a": 1, "b": 2}})
        + " and "
        + block({"name": "note", "arguments": {}})
        + " done"
    )
    parsed = parse_tool_calls(text, [ADD, NOTE])
    assert parsed.calls == [ToolCall(0, "add", {"a": 1, "b": 2}), ToolCall(1, "note", {})]
    assert parsed.errors == [] and parsed.text == "Let me add.  and  done"
    assert parse_tool_calls("no calls here").blocks == [] and parse_tool_calls("").text == ""
    # Without tools nothing is checked against a schema; arguments may be omitted or JSON-encoded.
    loose = parse_tool_calls(block({"name": "anything"}) + block({"name": "x", "arguments": '{"k": [1]}'}))
    assert loose.calls == [ToolCall(0, "anything", {}), ToolCall(1, "x", {"k": [1]})]
    # Raw newlines inside strings (code, as models write it) are accepted.
    assert parse_tool_calls(block('{"name": "py", "arguments": {"code": "a = 1\nprint(a)"}}')).calls[0].arguments == {
        "code": "a = 1\nprint(a)"
    }


@pytest.mark.parametrize(
    "body,fragment",
    [
        ('{"name": "add", "arguments": {"a": 1, "b": 2}', "invalid JSON (Expecting ',' delimiter at line 1 column"),
        ("{'name': 'add'}", "invalid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
        ('{"name": "add"} {"name": "add"}', "invalid JSON (Extra data"),
        ("", "empty; write"),
        ('["add", {"a": 1}]', 'must be a JSON object {"name": ..., "arguments": {...}}, got an array'),
        ('{"arguments": {"a": 1, "b": 2}}', 'has no "name"'),
        ('{"name": 3, "arguments": {}}', '"name" must be a non-empty string, got 3'),
        ('{"name": "add", "arguments": [1, 2]}', '"arguments" must be a JSON object, got an array'),
        ('{"name": "add", "arguments": "a=1"}', '"arguments" is a string that is not valid JSON'),
        ('{"name": "add", "arguments": null}', '"arguments" must be a JSON object, got a null'),
        ('{"name": "mul", "arguments": {}}', "unknown tool 'mul' (available: add, note)"),
        ('{"name": "add", "arguments": {"a": 1}}', "add: missing required argument 'b'"),
        ('{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}', "add: unexpected argument 'c'"),
        ('{"name": "add", "arguments": {"a": 1, "b": "2"}}', "add: argument 'b' must be integer, got a string"),
        ('{"name": "add", "arguments": {"a": true, "b": 2}}', "add: argument 'a' must be integer, got a boolean"),
    ],
)
def test_a_malformed_call_is_an_error_for_the_model_not_an_exception(body, fragment):
    parsed = parse_tool_calls("before " + block(body) + block({"name": "note", "arguments": {}}), [ADD, NOTE])
    error, call = parsed.blocks
    assert isinstance(error, ToolCallError) and error.index == 0 and call == ToolCall(1, "note", {})
    assert error.message.startswith("tool call 1: ") and fragment in error.message, error.message
    assert error.text == body.strip()[:200]


def test_unterminated_blocks_are_errors_and_a_stray_closing_tag_is_text():
    parsed = parse_tool_calls('<tool_call>{"name": "add"' + block({"name": "note"}) + '<tool_call>{"name": "n')
    first, second, third = parsed.blocks
    assert isinstance(first, ToolCallError)
    assert "not closed by </tool_call> before the next <tool_call>" in first.message
    assert second == ToolCall(1, "note", {})
    assert isinstance(third, ToolCallError) and "may have hit its token limit" in third.message
    assert third.text == '{"name": "n'
    assert parse_tool_calls("a </tool_call> b").text == "a </tool_call> b"


def test_tool_schemas_are_checked_and_messages_built():
    assert tool_names([ADD, NOTE]) == ["add", "note"]
    assert check_tools(None) is None and check_tools([]) is None
    copy = check_tools((ADD,))
    assert copy == [ADD] and copy[0] is not ADD
    for bad, fragment in [
        ({"name": "x"}, "must be a list"),
        (["x"], "tools[0] must be a function schema"),
        ([{"type": "function", "function": {}}], "tools[0] has no function name"),
        ([ADD, ADD], "'add' more than once"),
        ([{"name": "x", "f": object()}], "JSON-serialisable"),
    ]:
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            check_tools(bad)
    assert tool_message("5", name="add") == {"role": "tool", "content": "5", "name": "add"}
    assert tool_message(7, tool_call_id="c1") == {"role": "tool", "content": "7", "tool_call_id": "c1"}


# ---- the tiny tokenizers' tool-aware template ------------------------------------------------


@pytest.mark.parametrize("name", ["tiny_char", "tiny_bpe"])
def test_the_tiny_template_renders_tools_and_tool_messages_and_nothing_else_changes(name):
    tok = load_tokenizer(name)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": block({"name": "add", "arguments": {"a": 1, "b": 2}})},
        {"role": "tool", "name": "add", "content": "3"},
    ]
    text = tok.apply_chat_template(chat, tools=[ADD], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and text.count("Be brief.") == 1
    assert json.dumps(ADD) in text and '<tool_call>\n{"name": <function name>' in text
    assert text.endswith("<|im_start|>tool\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text  # the tiny vocabulary covers it
    plain = AutoTokenizer.from_pretrained(str(tokenizer_dir(name)))
    plain.chat_template = CHAR_CHAT_TEMPLATE
    for messages in (chat[:3], chat[1:3]):  # no tools: exactly the plain ChatML of before
        assert tok.apply_chat_template(messages, tokenize=False) == plain.apply_chat_template(messages, tokenize=False)
    structured = tok.apply_chat_template(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                    {"type": "function", "function": {"name": "note", "arguments": "{}"}},
                ],
            }
        ],
        tokenize=False,
    )
    assert structured == (
        "<|im_start|>assistant\n"
        + block({"name": "add", "arguments": {"a": 1, "b": 2}})
        + "\n"
        + block('{"name": "note", "arguments": {}}')
        + "<|im_end|>\n"
    )


# ---- tools= in the agent loop ----------------------------------------------------------------


class AddEnv:
    """Asks for a sum; answers `add` calls with role "tool" messages; ends on a bare number."""

    tools = [ADD]

    def reset(self, sample):
        self.turns = 0
        return [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "1 + 2?"}]

    def step(self, text):
        self.turns += 1
        parsed = parse_tool_calls(text, [ADD])
        if not parsed.blocks:
            return [], float(text.strip() == "3"), True, {}
        return (
            [
                tool_message(
                    str(sum(b.arguments.values())) if isinstance(b, ToolCall) else f"Error: {b.message}", name="add"
                )
                for b in parsed.blocks
            ],
            0.0,
            False,
            {},
        )


class Scripted:
    """Answers turn k with replies[k] (then the last one again), ending each on EOS."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.prompts = tok, replies, []

    async def generate(self, input_ids, sampling, rid=None, session=None):
        self.prompts.append(list(input_ids))
        ids = self.tok(self.replies[min(len(self.prompts) - 1, len(self.replies) - 1)], add_special_tokens=False)[
            "input_ids"
        ] + [self.tok.eos_token_id]
        return GenerateResult(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")


REPLIES = [
    "I will add. " + block({"name": "add", "arguments": {"a": 1, "b": 2}}),
    block('{"name": "add", "arguments": {"a": 1}}') + block({"name": "add", "arguments": {"a": 2, "b": 2}}),
    "3",
]


def run_one(tok, env, context, replies=REPLIES, sample=None):
    gen = Scripted(tok, replies)
    loop = AgentLoop(
        gen,
        tok,
        env,
        AgentLoopConfig(
            max_turns=4, context=context, max_input_length=8192, sampling=SamplingParams(max_new_tokens=64)
        ),
    )
    try:
        steps = asyncio.run(loop.run_trajectory(sample or {"prompt_id": "p"}, TrajectoryID("p", 0)))
    finally:
        loop.close()
    return steps, gen.prompts


@pytest.mark.parametrize("name", ["tiny_char", "tiny_bpe"])
def test_every_prompt_of_a_tool_env_is_rendered_with_its_tools_in_both_context_modes(name):
    tok = load_tokenizer(name)
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    chat = AddEnv().reset({})
    for reply, obs in zip(
        REPLIES,
        [
            [tool_message("3", name="add")],
            [
                tool_message("Error: tool call 1: add: missing required argument 'b'", name="add"),
                tool_message("4", name="add"),
            ],
        ],
    ):
        chat = chat + [{"role": "assistant", "content": reply}] + obs
    expected = [
        encode(tok.apply_chat_template(chat[:n], tools=[ADD], add_generation_prompt=True, tokenize=False))
        for n in (2, 4, 7)
    ]  # the chat before each of the three turns
    assert b"# Tools" in tok.decode(expected[0]).encode() and json.dumps(ADD) in tok.decode(expected[0])
    for context in ("retokenize", "tokens"):
        steps, prompts = run_one(tok, AddEnv, context)
        assert [s.stop_reason for s in steps] == ["stop"] * 3 and steps[-1].reward == 1.0
        if context == "retokenize" or name == "tiny_char":  # tiny_char never drifts: both modes are exact
            assert prompts == expected
        else:  # the BPE drifts: token mode keeps the sampled ids, the text is the same
            assert prompts[0] == expected[0] and tok.decode(prompts[-1]) == tok.decode(expected[-1])
        if context == "tokens":  # prompt + response + the template's delta (tool turns, generation prompt)
            deltas = [
                tool_turn("3"),
                tool_turn("Error: tool call 1: add: missing required argument 'b'") + tool_turn("4"),
            ]
            for prev, nxt, delta in zip(steps, steps[1:], deltas):
                assert prev.response_ids.tolist()[-1] == tok.eos_token_id
                assert nxt.prompt_ids.tolist() == (
                    prev.prompt_ids.tolist()
                    + prev.response_ids.tolist()
                    + encode("\n" + delta + "<|im_start|>assistant\n")
                )


def tool_turn(content):
    return f"<|im_start|>tool\n<tool_response>\n{content}\n</tool_response><|im_end|>\n"


def test_tools_may_be_a_method_sync_or_async_and_bad_tools_end_only_the_trajectory():
    tok = load_tokenizer("tiny_char")

    class Method(AddEnv):
        def reset(self, sample):
            self.offered = [ADD, NOTE]  # chosen per sample, after reset
            return super().reset(sample)

        def tools(self):  # a method replaces AddEnv's attribute
            return self.offered

    class Async(AddEnv):
        async def tools(self):
            return [NOTE]

    class Bad(AddEnv):
        tools = [{"function": {"description": "no name"}}]

    def rendered_tools(env):
        steps, prompts = run_one(tok, env, "retokenize", replies=["3"])
        return steps, tok.decode(prompts[0]) if prompts else ""

    steps, text = rendered_tools(Method)
    assert json.dumps(ADD) in text and json.dumps(NOTE) in text and steps[-1].reward == 1.0
    _, text = rendered_tools(Async)
    assert json.dumps(NOTE) in text and json.dumps(ADD) not in text
    steps, _ = rendered_tools(Bad)
    assert len(steps) == 1 and steps[0].stop_reason == "env_error"
    assert "env.tools" in steps[0].metadata["error"] and "tools[0] has no function name" in steps[0].metadata["error"]


@pytest.mark.launches  # the python tool runs in the sandbox's child process
def test_math_tool_runs_in_the_agent_loop_with_its_python_tool():
    tok, _ = tiny_lm("tiny_char")
    code = block({"name": "python", "arguments": {"code": "print(17 * 46)"}})
    sample = {"prompt_id": "p", "question": "How many bottles are in 46 crates of 17?", "answer": "782"}
    steps, prompts = run_one(tok, "math_tool", "tokens", replies=[code, "<answer>782</answer>"], sample=sample)
    first = tok.decode(prompts[0])
    assert '"name": "python"' in first and first.count("<tool_call>") >= 2  # the schema, the format, the example
    assert tok.decode(prompts[1]).endswith(
        "<|im_start|>tool\n<tool_response>\n782\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert [s.metadata["env_info"]["tool_calls"] for s in steps] == [1, 1] and steps[-1].reward == 1.0


# ---- model.chat_template ---------------------------------------------------------------------

UPPER = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if tools %}tools!{% endif %}"


def test_the_override_replaces_the_template_inline_or_from_a_file(tmp_path):
    shared = load_tokenizer("tiny_char")
    tok = load_tokenizer("tiny_char", chat_template=UPPER)
    assert tok is not shared and tok.chat_template == UPPER and shared.chat_template != UPPER
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[ADD], tokenize=False) == (
        "[user] hi\ntools!"
    )
    (tmp_path / "t.jinja").write_text(UPPER)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": UPPER}))
    for path in ("t.jinja", "chat_template.json"):
        assert read_chat_template(str(tmp_path / path)) == UPPER
        assert load_tokenizer("tiny_char", chat_template=str(tmp_path / path)).chat_template == UPPER


@pytest.mark.parametrize(
    "value,fragment",
    [
        ("/no/such/template.jinja", "no such file: /no/such/template.jinja"),
        ("{% for m in messages %}{{ m['content'] }}", "the inline template does not compile: TemplateSyntaxError"),
        ("{{ messages | nosuchfilter }}", "does not compile: TemplateAssertionError"),
    ],
)
def test_a_bad_override_fails_validation_naming_the_key(value, fragment, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"chat_template": value}}, probes=FakeProbes())
    assert e.value.keys == ["model.chat_template"] and fragment in str(e.value), str(e.value)
    with pytest.raises(ChatTemplateSourceError, match="^model.chat_template: "):
        read_chat_template(value)


def test_a_good_override_validates(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "t.jinja").write_text(UPPER)
    for value in (UPPER, str(tmp_path / "t.jinja")):
        assert config_from_dict({"model": {"chat_template": value}}, probes=FakeProbes()).model.chat_template == value
    (tmp_path / "empty.jinja").write_text("  \n")
    bad_json = tmp_path / "x.json"
    bad_json.write_text("[]")
    for path, fragment in ((tmp_path / "empty.jinja", "is empty"), (bad_json, "is not a chat_template.json")):
        with pytest.raises(ChatTemplateSourceError, match=fragment):
            read_chat_template(str(path))


def test_the_trainer_loads_its_tokenizer_with_the_override(monkeypatch):
    """`model.chat_template` reaches the tokenizer the trainer (and so the agent loop) renders with."""
    from megatron_stepwise.compose import components

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = config_from_dict({"model": {"chat_template": UPPER, "tokenizer": "tiny_char"}}, probes=FakeProbes())
    assert components.load_tokenizer(cfg).chat_template == UPPER
    plain = config_from_dict({"model": {"tokenizer": "tiny_char"}}, probes=FakeProbes())
    assert components.load_tokenizer(plain).chat_template != UPPER


# ---- the other formats --------------------------------------------------------------------------

SEARCH = function_tool(
    "search",
    "Search.",
    {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}, "required": ["q"]},
)


def test_qwen3_coder_xml_calls_inside_tool_call_blocks():
    text = (
        "let me look\n<tool_call>\n<function=search>\n<parameter=q>\nparis weather\n</parameter>\n"
        "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    turn = parse_tool_calls(text, [SEARCH])
    assert turn.calls == [ToolCall(0, "search", {"q": "paris weather", "n": 3})] and turn.text == "let me look"
    bad = parse_tool_calls("<tool_call>\n<function=>\n</function>\n</tool_call>", [SEARCH])
    assert "names no function" in bad.errors[0].message


def test_glm_calls():
    text = "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>x y</arg_value>\n</tool_call>"
    assert parse_tool_calls(text, [SEARCH], format="glm").calls == [ToolCall(0, "search", {"q": "x y"})]
    turn = parse_tool_calls("<tool_call>\n<arg_key>q</arg_key></tool_call>", [SEARCH], format="glm")
    assert "function name first" in turn.errors[0].message
    unknown = parse_tool_calls("<tool_call>find\n</tool_call>", [SEARCH], format="glm")
    assert "unknown tool 'find'" in unknown.errors[0].message


def test_llama3_json_calls():
    two = '{"name": "search", "parameters": {"q": "a"}}; {"name": "search", "parameters": {"q": 1}}'
    turn = parse_tool_calls(two, [SEARCH], format="llama3_json")
    assert turn.calls == [ToolCall(0, "search", {"q": "a"})] and "must be string" in turn.errors[0].message
    tagged = parse_tool_calls(
        '<|python_tag|>{"name": "search", "parameters": {"q": "a"', [SEARCH], format="llama3_json"
    )
    assert "invalid JSON" in tagged.errors[0].message
    plain = parse_tool_calls("The answer is 4.", [SEARCH], format="llama3_json")
    assert plain.blocks == [] and plain.text == "The answer is 4."
    with pytest.raises(ValueError, match="tool call format must be one of"):
        parse_tool_calls("x", format="mistral")


@pytest.mark.parametrize("format", ["hermes", "glm", "llama3_json"])
def test_no_model_output_makes_a_parser_raise(format):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    pieces = st.sampled_from(
        [
            "<tool_call>",
            "</tool_call>",
            "<function=",
            "<parameter=q>",
            "</parameter>",
            "</function>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "{",
            "}",
            "[",
            "]",
            '"name"',
            ":",
            '"search"',
            '"parameters"',
            '"arguments"',
            ",",
            ";",
            "\n",
            "<|python_tag|>",
            "1",
            "null",
            '"q"',
            "x",
        ]
    )

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(st.lists(pieces | st.text(max_size=5), max_size=30))
    def check(parts):
        parse_tool_calls("".join(parts), [SEARCH], format=format)

    check()
    deep = "[" * 100_000  # deeper than Python's JSON decoder recurses
    for text in (
        f"<tool_call>{deep}</tool_call>",
        deep.replace("[", '{"a":'),
        f"<tool_call>x\n<arg_key>a</arg_key><arg_value>{deep}</arg_value></tool_call>",
    ):
        parse_tool_calls(text, [SEARCH], format=format)
