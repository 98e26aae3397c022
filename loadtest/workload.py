"""Deterministic synthetic chat workloads: the same seed gives byte-identical requests.

Every text is drawn from :data:`WORDS` by a ``random.Random`` seeded with a string naming what it is
(seed, kind, index), so any request can be rebuilt on its own, in any process, in any order: the
Locust users, the A/B runner and the report all see the same prompts. Each word of :data:`WORDS` is
one token of the SmolLM2 (and most GPT-2-style BPE) vocabularies with or without a leading space,
so "N tokens" below means N words, and a prompt's token count is its word count plus the chat
template's few tokens per message.

Assistant turns in the history are the workload's own scripted answers, not the model's output:
the model is asked for exactly as many tokens (``ignore_eos``), so the engine does the same work,
while the conversation stays independent of what a (possibly random-weight) model generated,
of sampling noise and of failed requests. That is what makes the workload identical across routing
policies and its single-cache ideal computable from the workload alone.

This module must not import locust (pytest and the runner import it).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

WORDS: tuple[str, ...] = tuple("""
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community
name president team minute idea kid body information back parent face others level office door
health person art war history party result change reason research girl moment air teacher force
education foot boy age policy process music market sense nation plan college interest death
experience effect use class control care field development role rate heart drug show leader light
voice wife mind price report decision son view relationship town road arm difference value building
action model season tax director position player record paper space ground form event official
matter center site project activity star table need court oil cost industry figure street image
phone data picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair window
evidence population truth song rock language boat pressure river sound camera sea file able bad best
better big black certain clear different early easy economic free full good great hard high human
important international large late little local long low major military national new old only other
political possible public real recent small social special strong true
""".split())

# Chat-template tokens around one message (ChatML: "<|im_start|>role\n" ... "<|im_end|>\n"), used
# only to bound a prompt's length; the report counts real tokens with the real tokenizer.
TEMPLATE_TOKENS_PER_MESSAGE = 8

AGENT = "agent"
CHAT = "chat"


class TokenRange(NamedTuple):
    """An inclusive range of token (word) counts, drawn uniformly."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> TokenRange:
        """``"200-1300"`` or a single ``"500"``; raises ValueError with the reason."""
        lo_text, sep, hi_text = text.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if sep else lo
        except ValueError:
            raise ValueError(f"{text!r} is not a token range like 200-1300") from None
        if not 1 <= lo <= hi:
            raise ValueError(f"{text!r}: a token range needs 1 <= LO <= HI")
        return cls(lo, hi)

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}"

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The whole workload in a few numbers. Validated at construction."""

    seed: int = 0
    system_prompts: int = 4  # K shared system prompts
    system_tokens: TokenRange = TokenRange(1000, 3000)
    turns: int = 8  # per agent conversation
    user_tokens: TokenRange = TokenRange(200, 1300)  # new user text per agent turn
    answer_tokens: TokenRange = TokenRange(8, 32)  # tokens asked of the model per request
    chat_tokens: TokenRange = TokenRange(200, 1300)  # the one user message of a chat request

    def __post_init__(self) -> None:
        if self.system_prompts < 1:
            raise ValueError(f"system_prompts must be >= 1, got {self.system_prompts}")
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")

    def max_prompt_tokens(self) -> int:
        """An upper bound of any request's prompt tokens (the last agent turn, or a chat request)."""
        agent = (self.system_tokens.hi + self.turns * self.user_tokens.hi
                 + (self.turns - 1) * self.answer_tokens.hi + 2 * self.turns * TEMPLATE_TOKENS_PER_MESSAGE)
        chat = self.system_tokens.hi + self.chat_tokens.hi + 2 * TEMPLATE_TOKENS_PER_MESSAGE
        return max(agent, chat) + TEMPLATE_TOKENS_PER_MESSAGE  # the generation prompt

    def max_request_tokens(self) -> int:
        """An upper bound of prompt plus completion: what the model's context must hold."""
        return self.max_prompt_tokens() + self.answer_tokens.hi

    def to_argv(self) -> list[str]:
        """The flags of :func:`add_workload_arguments` that rebuild this config."""
        return ["--workload-seed", str(self.seed), "--system-prompts", str(self.system_prompts),
                "--system-tokens", str(self.system_tokens), "--turns", str(self.turns),
                "--user-tokens", str(self.user_tokens), "--answer-tokens", str(self.answer_tokens),
                "--chat-tokens", str(self.chat_tokens)]

    def to_json(self) -> dict:
        return {"seed": self.seed, "system_prompts": self.system_prompts, "system_tokens": str(self.system_tokens),
                "turns": self.turns, "user_tokens": str(self.user_tokens),
                "answer_tokens": str(self.answer_tokens), "chat_tokens": str(self.chat_tokens)}

    @classmethod
    def from_json(cls, data: dict) -> WorkloadConfig:
        ranges = ("system_tokens", "user_tokens", "answer_tokens", "chat_tokens")
        return cls(**{k: TokenRange.parse(v) if k in ranges else v for k, v in data.items()})

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> WorkloadConfig:
        return cls(seed=options.workload_seed, system_prompts=options.system_prompts,
                   system_tokens=options.system_tokens, turns=options.turns, user_tokens=options.user_tokens,
                   answer_tokens=options.answer_tokens, chat_tokens=options.chat_tokens)


def _range_arg(text: str) -> TokenRange:
    try:
        return TokenRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_pause_arguments(parser: argparse.ArgumentParser) -> None:
    """The pacing flags, shared by the runner's parser and Locust's (see :meth:`Workload.pauses` and
    :meth:`Workload.arrivals`)."""
    group = parser.add_argument_group("pacing (exponential pauses and arrivals, seeded)")
    group.add_argument("--think-time", type=float, default=0.0, metavar="S",
                       help="mean seconds a user waits between requests (an agent's tool calls; 0 = none)")
    group.add_argument("--conversation-gap", type=float, default=0.0, metavar="S",
                       help="AgentUser: mean seconds before each conversation (the first one too). A gap much "
                            "longer than a conversation makes arrivals a near-Poisson stream of about users / "
                            "(gap + conversation time) per second, nearly the same for every policy; 0 = back to "
                            "back, a closed loop, where a faster policy gets more work")
    group.add_argument("--conversation-rate", type=float, default=0.0, metavar="R",
                       help="AgentUser, instead of --conversation-gap: conversations arrive as one seeded Poisson "
                            "stream of R per second from the start of the run, the same for every policy (an open "
                            "loop); user n takes arrivals n, n + U, ..., so U users cap the conversations in "
                            "flight, and a conversation whose user is still busy starts late (its record's "
                            "start_lag_ms says by how much)")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags, shared by the runner's parser and Locust's (plain argparse keywords only)."""
    d = WorkloadConfig()
    group = parser.add_argument_group("workload (token counts are words of a fixed vocabulary)")
    group.add_argument("--workload-seed", type=int, default=d.seed, help="seed of all texts and sizes")
    group.add_argument("--system-prompts", type=_positive_int, default=d.system_prompts,
                       help=f"K shared system prompts (default: {d.system_prompts})")
    group.add_argument("--system-tokens", type=_range_arg, default=d.system_tokens, metavar="LO-HI",
                       help=f"tokens of each system prompt (default: {d.system_tokens})")
    group.add_argument("--turns", type=_positive_int, default=d.turns,
                       help=f"turns of an agent conversation (default: {d.turns})")
    group.add_argument("--user-tokens", type=_range_arg, default=d.user_tokens, metavar="LO-HI",
                       help=f"new user tokens per agent turn (default: {d.user_tokens})")
    group.add_argument("--answer-tokens", type=_range_arg, default=d.answer_tokens, metavar="LO-HI",
                       help=f"completion tokens asked per request (default: {d.answer_tokens})")
    group.add_argument("--chat-tokens", type=_range_arg, default=d.chat_tokens, metavar="LO-HI",
                       help=f"user tokens of a single-turn chat request (default: {d.chat_tokens})")


class Turn(NamedTuple):
    user: str  # the user message of this turn
    answer: str  # the scripted assistant answer that the next turn carries in its history
    max_tokens: int  # completion tokens asked of the model (the answer's length)


@dataclass(frozen=True, slots=True)
class Conversation:
    kind: str  # AGENT or CHAT
    index: int
    system_index: int
    system: str
    turns: tuple[Turn, ...]

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The request of ``turn``: the system prompt, every earlier turn with its answer, the new user text."""
        if not 0 <= turn < len(self.turns):
            raise IndexError(f"{self.kind} conversation {self.index} has {len(self.turns)} turns, not {turn + 1}")
        messages = [{"role": "system", "content": self.system}]
        for earlier in self.turns[:turn]:
            messages += [{"role": "user", "content": earlier.user}, {"role": "assistant", "content": earlier.answer}]
        messages.append({"role": "user", "content": self.turns[turn].user})
        return messages


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(WORDS, k=count))


class Workload:
    """Conversations by (kind, index). Pure functions of the config; system prompts are memoized."""

    def __init__(self, config: WorkloadConfig):
        self.config = config
        self.system_prompt = functools.lru_cache(maxsize=None)(self._system_prompt)

    def _rng(self, *name: object) -> random.Random:
        # A str seed is hashed with SHA-512: stable across processes and PYTHONHASHSEED.
        return random.Random("/".join(map(str, ("kvgate-loadtest", self.config.seed, *name))))

    def _system_prompt(self, k: int) -> str:
        rng = self._rng("system", k)
        return words(rng, self.config.system_tokens.draw(rng))

    def pauses(self, what: str, user: int, mean_s: float) -> Iterator[float]:
        """User ``user``'s pauses of kind ``what``: exponential with mean ``mean_s`` (0: none), seeded."""
        if mean_s < 0:
            raise ValueError(f"a mean pause must be at least 0 s, got {mean_s}")
        rng = self._rng("pause", what, user)
        return (rng.expovariate(1.0 / mean_s) if mean_s > 0 else 0.0 for _ in itertools.repeat(None))

    def arrivals(self, rate_per_s: float) -> Iterator[float]:
        """Seconds from the start of the run at which conversations 0, 1, 2, ... arrive: Poisson, seeded."""
        if rate_per_s <= 0:
            raise ValueError(f"an arrival rate must be positive, got {rate_per_s}")
        rng = self._rng("arrivals")
        return itertools.accumulate(rng.expovariate(rate_per_s) for _ in itertools.repeat(None))

    def agent(self, index: int) -> Conversation:
        """Agent conversation ``index``: one of the K system prompts, then ``turns`` turns."""
        c = self.config
        rng = self._rng(AGENT, index)
        system_index = rng.randrange(c.system_prompts)
        turns = []
        for _ in range(c.turns):
            user = words(rng, c.user_tokens.draw(rng))
            max_tokens = c.answer_tokens.draw(rng)
            turns.append(Turn(user, words(rng, max_tokens), max_tokens))
        return Conversation(AGENT, index, system_index, self.system_prompt(system_index), tuple(turns))

    def chat(self, index: int) -> Conversation:
        """Single-turn chat request ``index``: one of the K system prompts and one user message."""
        c = self.config
        rng = self._rng(CHAT, index)
        system_index = rng.randrange(c.system_prompts)
        user = words(rng, c.chat_tokens.draw(rng))
        max_tokens = c.answer_tokens.draw(rng)
        turn = Turn(user, words(rng, max_tokens), max_tokens)
        return Conversation(CHAT, index, system_index, self.system_prompt(system_index), (turn,))

    def conversation(self, kind: str, index: int) -> Conversation:
        if kind == AGENT:
            return self.agent(index)
        if kind == CHAT:
            return self.chat(index)
        raise ValueError(f"unknown conversation kind {kind!r}; expected {AGENT!r} or {CHAT!r}")
