"""What the target answers to make a head's data: instructions, and the JSON-lines file
that holds them (`train-head --instructions`, `serve --record-prompts`).

Each line is one object with exactly one of:
- "prompt": text, one user turn answered through the chat template;
- "messages": a conversation in the OpenAI chat format ({"role", "content"} objects,
  roles system, developer, user and assistant, content text or a list of text parts),
  answered through the chat template as the chat endpoint answers it. Trailing
  assistant turns are dropped, so that a fine-tuning file's answers are written again
  by the target; the conversation must then end with a user turn. An agent's
  conversation may also hold "tools" beside "messages" (OpenAI tool objects, listed by
  the template), assistant turns with "tool_calls", and "tool" turns with the calls'
  results; it may end with a tool turn, whose result the target answers;
- "text": a plain prompt the target continues without the chat template, as the
  completions endpoint does;

and an optional "kind" (default "general"): instructions the target writes are modelled
on those of one kind. Blank lines are skipped.

Invariant: `Instruction.to_line` writes what `parse_line` reads back as the same
instruction, so the prompts a server records train a head on the prompts it served.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from specserve.errors import ConfigError
from specserve.tokenizer import CHAT_ROLES, Tokenizer, template_arguments, template_role

BUNDLED_PATH = Path(__file__).with_name("instructions.jsonl")
USER_KIND = "general"  # of a user's instruction that names none
MIN_INSTRUCTIONS = 2  # one held out to measure the head, at least one to train on
LINE_FORMAT = (
    '{"prompt": "..."}, {"messages": [{"role": "user", "content": "..."}]} (with "tools" where it calls them) '
    'or {"text": "..."}'
)


@dataclass(frozen=True)
class Instruction:
    kind: str  # the bundled: code, structured, explanation, chat, math, rewriting
    prompt: str  # the last user turn's text; a plain prompt's whole text
    before: tuple[tuple[str, str], ...] = ()  # a conversation's earlier turns, (role, text)
    templated: bool = True  # False: a plain prompt, continued without the chat template
    # A conversation with tools or tool turns, whole: {"messages": [...], "tools": [...]}
    # as JSON text (prompt is then its last user text, before empty); "" for any other.
    agent: str = ""

    def messages(self) -> list[dict[str, Any]]:
        """The conversation the chat template renders (templated instructions)."""
        if self.agent:
            return json.loads(self.agent)["messages"]
        return [{"role": role, "content": text} for role, text in [*self.before, ("user", self.prompt)]]

    def tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template lists; None: none."""
        return json.loads(self.agent).get("tools") if self.agent else None

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The ids the target answers, as the chat or the completions endpoint reads them."""
        if not self.templated:
            return tokenizer.encode(self.prompt)
        return tokenizer.encode_chat(self.messages(), tools=self.tools())

    def texts(self) -> list[str]:
        """Every text the instruction holds (an agent's calls' arguments and results too)."""
        if self.agent:
            return [
                text
                for message in self.messages()
                for text in [message["content"] or ""]
                + [json.dumps(call["function"]["arguments"]) for call in message.get("tool_calls", ())]
            ]
        return [text for _, text in self.before] + [self.prompt]

    def to_line(self) -> str:
        """The JSON line `parse_line` reads as this instruction."""
        if not self.templated:
            record: dict[str, Any] = {"text": self.prompt}
        elif self.agent:
            record = json.loads(self.agent)  # {"messages": [...]}, and "tools" where it has them
        elif self.before:
            record = {"messages": self.messages()}
        else:
            record = {"prompt": self.prompt}
        return json.dumps(record | {"kind": self.kind}, ensure_ascii=False)


def from_messages(messages: list[dict[str, Any]], kind: str, tools: Any = None) -> Instruction:
    """A conversation (and the tools it may call) as an instruction: trailing assistant
    turns dropped. Raises ValueError saying what is wrong with it."""
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError('"tools" is not a list of tool objects')
    agent = bool(tools) or any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages
    )
    roles = [*CHAT_ROLES, "tool"] if agent else list(CHAT_ROLES)
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] is not an object")
        role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
        if role not in roles:
            raise ValueError(f"messages[{i}] has role {role!r}; use one of {roles}")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(str(p.get("text", "")) for p in content)
        if content is None and calls and role == "assistant":
            content = ""  # a turn that only calls
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}] holds no text content")
        turn = {"role": template_role(role), "content": content}
        if calls:
            turn["tool_calls"] = _calls(calls, i)
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            turn["tool_call_id"] = message["tool_call_id"]
        turns.append(turn)
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    users = [t["content"] for t in turns if t["role"] == "user" and t["content"].strip()]
    if agent:
        if not turns or turns[-1]["role"] not in ("user", "tool") or not users:
            raise ValueError(
                "the conversation does not end with a user or tool turn (after its assistant turns), "
                "or no user turn holds text"
            )
        whole = {"messages": turns} | ({"tools": tools} if tools else {})
        return Instruction(kind, users[-1], agent=json.dumps(whole, ensure_ascii=False))
    if not turns or turns[-1]["role"] != "user" or not turns[-1]["content"].strip():
        raise ValueError("the conversation does not end with a user turn that holds text (after its assistant turns)")
    return Instruction(kind, turns[-1]["content"], tuple((t["role"], t["content"]) for t in turns[:-1]))


def _calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant turn's tool_calls as templates read them (`template_arguments`), as
    the chat endpoint passes them."""
    if not (
        isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)
    ):
        raise ValueError(f'messages[{index}]\'s "tool_calls" is not a list of calls with a "function"')
    read = []
    for call in calls:
        function = dict(call["function"])
        if not isinstance(function.get("name"), str):
            raise ValueError(f"messages[{index}] calls a function with no name")
        function["arguments"] = template_arguments(function.get("arguments", {}))
        read.append({**call, "type": call.get("type", "function"), "function": function})
    return read


def parse_line(record: Any) -> Instruction:
    """One line's object as an instruction; raises ValueError saying what is wrong."""
    if not isinstance(record, dict):
        raise ValueError("not an object")
    given = [key for key in ("prompt", "messages", "text") if key in record]
    if len(given) != 1:
        raise ValueError(f"it holds {' and '.join(given) or 'none'} of prompt, messages and text; give one")
    kind = record.get("kind", USER_KIND)
    if not (isinstance(kind, str) and kind.strip()):
        raise ValueError('"kind" not text')
    kind, value = kind.strip(), record[given[0]]
    if "tools" in record and given[0] != "messages":
        raise ValueError('"tools" goes with "messages" alone')
    if given[0] == "messages":
        if not (isinstance(value, list) and value):
            raise ValueError('"messages" is not a list of messages')
        return from_messages(value, kind, record.get("tools"))
    if not (isinstance(value, str) and value.strip()):
        raise ValueError(f'no text in "{given[0]}"')
    if given[0] == "prompt":
        return Instruction(kind, value.strip())
    return Instruction(kind, value, templated=False)  # a plain prompt's spaces are part of it


def lines_of(text: str) -> list[str]:
    """A JSON-lines text's lines: split at newlines alone, since JSON text may hold the
    other characters str.splitlines splits at (U+2028, U+0085) unescaped."""
    return text.split("\n")


class InstructionsFile(NamedTuple):
    """A user's instructions file as one read of it found it."""

    instructions: list[Instruction]  # each once, in the order of its first line
    sha256: str  # of the file's bytes
    repeated: int  # lines that repeat an instruction before them


def read_instructions_file(path: str | Path) -> InstructionsFile:
    """A user's JSON-lines file (the module docstring), read once. A file that cannot
    serve raises ConfigError naming the file, the line and the fix."""
    path = Path(path)
    try:
        contents = path.read_bytes()
        lines = lines_of(contents.decode("utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--instructions {path}: cannot read it ({e}); give a UTF-8 JSON-lines file") from None
    read = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            read.append(parse_line(json.loads(line)))
        except (json.JSONDecodeError, ValueError) as e:
            error = f"not JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)
            raise ConfigError(
                f'--instructions {path}, line {number}: {error}; each line is {LINE_FORMAT}, with an optional "kind"'
            ) from None
    instructions = list(dict.fromkeys(read))
    if len(instructions) < MIN_INSTRUCTIONS:
        raise ConfigError(
            f"--instructions {path} holds {len(instructions)} instructions; a head needs at least "
            f"{MIN_INSTRUCTIONS} (one held out to measure it, one to train on)"
        )
    return InstructionsFile(instructions, hashlib.sha256(contents).hexdigest(), len(read) - len(instructions))


def load_instructions(path: str | Path | None = None) -> list[Instruction]:
    """The bundled instructions, or a user's file's (`read_instructions_file`), each
    instruction once (the first line of it: recorded traffic repeats prompts, and a copy of
    a held-out one among those trained on would overrate the head)."""
    if path is None:
        lines = BUNDLED_PATH.read_text(encoding="utf-8").splitlines()
        return [Instruction(**json.loads(line)) for line in lines if line.strip()]
    return read_instructions_file(path).instructions
