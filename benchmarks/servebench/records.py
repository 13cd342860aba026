"""The benchmark's work (one prompt per client) and what a client records of a stream."""

from __future__ import annotations

from dataclasses import dataclass, field

TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint in an abandoned city",
    "two rival bakers in a small mountain village",
    "a girl who can talk to the wind",
    "the last dragon guarding an empty library",
    "a detective cat solving a mystery on a train",
    "an astronaut stranded on a frozen moon",
    "a musician who loses her hearing before a great concert",
    "a family of foxes surviving a harsh winter",
    "a clockmaker who builds a machine that stops time",
    "a pirate captain afraid of the sea",
    "a young wizard failing his final exam",
    "a gardener whose plants grow overnight into a forest",
    "a knight searching for a stolen crown",
    "an old fisherman and a talking whale",
    "a city where it never stops raining",
]
WARMUP_TOKENS = 8


def story_prompt(i: int) -> list[dict[str, str]]:
    """The chat messages of client ``i``: distinct per client, asking for a long answer."""
    topic = TOPICS[i % len(TOPICS)]
    part = f" (version {i // len(TOPICS) + 1})" if i >= len(TOPICS) else ""
    text = (
        f"Write a long story about {topic}{part}. "
        "Describe the characters, the places and every event in detail."
    )
    return [{"role": "user", "content": text}]


@dataclass
class Stream:
    """One request as its client saw it; times are ``time.perf_counter()`` seconds."""

    sent: float
    first: float | None = None  # first token (first text chunk, or the end if none)
    end: float | None = None  # the chunk carrying finish_reason
    chunks: list[float] = field(default_factory=list)  # text chunks (tokens, for the ceiling)
    tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    retries: int = 0  # connections that broke before a response and were retried


@dataclass
class Wave:
    """C streams started together at ``t0``."""

    system: str
    concurrency: int
    t0: float
    streams: list[Stream]
    peak_kv_bytes: int | None = None
    background_cores: float | None = None  # CPU others used meanwhile, in cores
