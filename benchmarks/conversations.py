"""Multi-turn long-context conversations for the multi-turn benchmark, deterministic by seed.

LoopServe's benchmark (paper section 4, appendix A.4) builds conversations from LongBench items; we
build them from a procedurally generated local corpus instead (nothing to download) with tasks a
135M model can score on, keeping its two axes:

- question position: each turn's question goes at the ``begin``, ``middle`` (between two context
  sentences at the middle) or ``end`` of the turn's user message;
- context relevance: the evidence of a turn's question lives in the current turn or only in
  earlier turns (``depends_on``); every piece of evidence is recorded as a character span of its
  turn's user message (and a token span once :func:`attach_token_spans` ran).

Task families (``TASKS``): ``passkey`` (one labelled pass key per turn, asked for a key of this or
an earlier turn), ``kv`` (a table of key-value records per turn), ``vartrack`` (RULER-style
variable chains that grow across turns; list every variable holding a value, F1 scored),
``count`` (an event repeated across turns; how many times so far) and ``trec`` (few-shot question
classification in the TREC style, example groups spread across turns).

The assistant turns of the history are the gold answers, so every system sees the same prompts.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

TASKS = ("passkey", "kv", "vartrack", "count", "trec")
POSITIONS = ("begin", "middle", "end")
SYSTEM_PROMPT = "You are a careful assistant. Read the whole conversation and answer with only the answer."

# --- corpus: plausible, digit-free English sentences ---------------------------------------------
_TOWNS = "Marlow Ashford Kelby Dunmore Halden Corrin Bexley Tarnow Wexham Lindell Orrin Salt Harbour".split()
_NAMES = "Ada Bruno Clara Dmitri Elena Farid Greta Hugo Ines Jonas Kira Lukas Mira Nadia Oskar Priya".split()
_PLACES = "bridge market library harbour station museum garden mill square chapel quay orchard tower".split()
_OBJECTS = "roof lantern clock fence boat wagon organ archive map ledger bell window statue kiln loom".split()
_TOPICS = "weather harvest taxes the river trade the railway music schooling fishing the old war maps".split()
_ADJS = "quiet crowded flooded restored narrow painted forgotten famous damaged busy ancient".split()
_VERBS = "repaired rebuilt painted measured sold moved cleaned inspected photographed described".split()
_TIMES = "one spring|that winter|in the autumn|after the storm|before the fair|at dawn|late one evening".split("|")
_TEMPLATES = (
    "{time}, the council of {town} {verb} the {obj} near the {place}.",
    "{name} walked to the {place} of {town} and talked for hours about {topic}.",
    "The {place} in {town} was {adj} {time}, and nobody could say why.",
    "{name} kept a small notebook about {topic} and the {adj} {place}.",
    "Travellers from {town} said the {obj} by the {place} looked {adj}.",
    "{time}, {name} {verb} an {adj} {obj} that had belonged to a neighbour.",
    "Most people in {town} agreed that {topic} mattered more than the {obj}.",
    "A letter from {name} described the {place} of {town} as {adj} and cold.",
)


def filler_sentence(rng: random.Random) -> str:
    t = rng.choice(_TEMPLATES)
    s = t.format(
        time=rng.choice(_TIMES),
        town=rng.choice(_TOWNS),
        verb=rng.choice(_VERBS),
        obj=rng.choice(_OBJECTS),
        place=rng.choice(_PLACES),
        name=rng.choice(_NAMES),
        topic=rng.choice(_TOPICS),
        adj=rng.choice(_ADJS),
    )
    return s[0].upper() + s[1:]


# --- TREC-style question bank: (template, label); slots filled from small word lists -------------
_TREC = {
    "location": ["Where is the {place} of {town}?", "In which country is {town}?", "Where did {name} grow up?"],
    "number": ["How many {obj}s are in {town}?", "When was the {place} of {town} built?", "How old is {name}?"],
    "human": ["Who repaired the {obj} in {town}?", "Who wrote the book about {topic}?", "Who founded {town}?"],
    "description": ["Why is the {place} of {town} {adj}?", "What does a {obj} do?", "How does {topic} work?"],
    "entity": ["What kind of {obj} did {name} buy?", "What animal lives near the {place}?", "What color is the {obj}?"],
    "abbreviation": ["What does {abbr} stand for?", "What is the abbreviation for the {place} of {town}?"],
}
TREC_LABELS = tuple(_TREC)


def trec_question(rng: random.Random, label: str) -> str:
    abbr = "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(2, 4)))
    return rng.choice(_TREC[label]).format(
        place=rng.choice(_PLACES),
        town=rng.choice(_TOWNS),
        name=rng.choice(_NAMES),
        obj=rng.choice(_OBJECTS),
        topic=rng.choice(_TOPICS),
        adj=rng.choice(_ADJS),
        abbr=abbr,
    )


# --- data model ------------------------------------------------------------------------------------
@dataclass
class Evidence:
    turn: int
    char_span: tuple[int, int]  # in that turn's user message
    token_span: tuple[int, int] | None = None  # in that turn's user message tokens (attach_token_spans)


@dataclass
class Turn:
    user: str
    question: str
    answer: str | list[str]  # a list = every item must be named (F1)
    metric: str  # "em" | "f1"
    position: str
    depends_on: list[int]
    evidence: list[Evidence]
    max_tokens: int = 16

    @property
    def gold_reply(self) -> str:
        return ", ".join(self.answer) if isinstance(self.answer, list) else self.answer


@dataclass
class Conversation:
    id: str
    task: str
    seed: int
    target_tokens: int
    turns: list[Turn] = field(default_factory=list)

    def messages(self, upto: int) -> list[dict]:
        """The chat messages of turn ``upto``: system, the earlier turns with gold replies, the turn."""
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
        for t in self.turns[:upto]:
            msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.gold_reply}]
        return msgs + [{"role": "user", "content": self.turns[upto].user}]

    def to_dict(self) -> dict:
        return asdict(self)


# --- building one turn -------------------------------------------------------------------------------
@dataclass
class _Draft:
    """Context sentences of a turn; ``marked`` maps a sentence index to the evidence it is."""

    sentences: list[str]
    marked: dict[int, int] = field(default_factory=dict)  # sentence index -> evidence id


def _fill(rng: random.Random, inserts: list[tuple[str, int]], budget: int, count: Callable[[str], int]) -> _Draft:
    """Filler sentences up to ``budget`` tokens with each insert (sentence, evidence id) at a random place."""
    used = sum(count(s) for s, _ in inserts)
    sentences: list[str] = []
    while used < budget:
        s = filler_sentence(rng)
        sentences.append(s)
        used += count(s) + 1
    draft = _Draft(sentences)
    slots = sorted(rng.randint(0, len(sentences)) for _ in inserts)
    for k, ((sent, ev), slot) in enumerate(zip(inserts, slots)):
        at = slot + k  # earlier inserts shifted the later slots by one each
        draft.sentences.insert(at, sent)
        draft.marked = {(i + 1 if i >= at else i): e for i, e in draft.marked.items()}
        draft.marked[at] = ev
    return draft


def _render(draft: _Draft, question: str, position: str) -> tuple[str, dict[int, tuple[int, int]]]:
    """The user message with the question at ``position`` (its own paragraph); evidence id -> span."""
    q_at = {"begin": 0, "middle": len(draft.sentences) // 2, "end": len(draft.sentences)}[position]
    text, spans = "", {}
    for i, sent in enumerate(draft.sentences + [None]):
        if i == q_at:
            text += ("\n\n" if text else "") + question + ("\n\n" if sent is not None else "")
        elif text and sent is not None:
            text += " "
        if sent is not None:
            if i in draft.marked:
                spans[draft.marked[i]] = (len(text), len(text) + len(sent))
            text += sent
    return text, spans


def _num(rng: random.Random, used: set[str], digits: int = 5) -> str:
    while True:
        n = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if n not in used:
            used.add(n)
            return n


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        n = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if n not in used:
            used.add(n)
            return n


# --- task families -----------------------------------------------------------------------------------
def _dep(rng: random.Random, t: int) -> int:
    """The turn holding the evidence: the current one, or (half the time after turn 0) an earlier one."""
    return t if t == 0 or rng.random() < 0.5 else rng.randint(0, t - 1)


def _gen_lookup(rng, n_turns, budgets, count, task):
    """passkey / kv: turn t inserts its records; the question asks for one record of turn _dep(t)."""
    used: set[str] = set()
    labels = rng.sample([f"{c} {o}" for c in "red blue green amber silver violet".split() for o in _OBJECTS], 60)
    records = []  # per turn: list of (sentence, key, value)
    for _t in range(n_turns):
        k = 2 if task == "passkey" else 3
        recs = []
        for _ in range(k):
            key, val = labels.pop(), _num(rng, used)
            s = (
                f"The pass key for the {key} is {val}. Remember it: the pass key for the {key} is {val}."
                if task == "passkey"
                else f"The value of the key '{key}' is {val}."
            )
            recs.append((s, key, val))
        records.append(recs)
    turns, asked = [], set()
    for t in range(n_turns):
        # never ask a record twice: its gold reply is in the history
        open_ = [u for u in range(t) if any(r[1] not in asked for r in records[u])]
        d = rng.choice(open_) if open_ and _dep(rng, t) < t else t
        s, key, val = rng.choice([r for r in records[d] if r[1] not in asked])
        asked.add(key)
        q = (
            f"What is the pass key for the {key}? Answer with the number only."
            if task == "passkey"
            else f"What is the value of the key '{key}'? Answer with the number only."
        )
        turns.append((records[t], q, val, "em", [(d, s)], [d], 24))
    return _assemble(rng, turns, budgets, count)


def _gen_vartrack(rng, n_turns, budgets, count):
    """Two chains (target and distractor) grow by one or two hops per turn; list the target's members."""
    used_names: set[str] = set()
    used_nums: set[str] = set()
    chains = [[_name(rng, used_names)] for _ in range(2)]
    values = [_num(rng, used_nums) for _ in range(2)]
    per_turn = []  # per turn: [(sentence, chain index, name)]
    for t in range(n_turns):
        recs = []
        for c in range(2):
            if t == 0:
                recs.append((f"VAR {chains[c][0]} = {values[c]}.", c, chains[c][0]))
            for _ in range(rng.randint(1, 2)):
                new = _name(rng, used_names)
                recs.append((f"VAR {new} = VAR {rng.choice(chains[c])}.", c, new))
                chains[c].append(new)
        per_turn.append(recs)
    turns = []
    for t in range(n_turns):
        members = [(u, s, n) for u in range(t + 1) for s, c, n in per_turn[u] if c == 0]
        q = (
            f"Which variables hold the value {values[0]}, directly or through other variables, in everything "
            "said so far? List their names separated by commas."
        )
        turns.append(
            (
                [(s, None, None) for s, _, _ in per_turn[t]],
                q,
                [n for _, _, n in members],
                "f1",
                [(u, s) for u, s, _ in members],
                sorted({u for u, _, _ in members}),
                48,
            )
        )
    return _assemble(rng, turns, budgets, count)


def _gen_count(rng, n_turns, budgets, count):
    """An event sentence 1-3 times per turn; how many times so far (the whole history is the evidence)."""
    event = rng.choice(["the tower bell rang", "a grey heron landed on the quay", "the ferry horn sounded"])
    sentence = event[0].upper() + event[1:] + " once."
    per_turn = [[(sentence, None, None)] * rng.randint(1, 3) for _ in range(n_turns)]
    turns, total = [], 0
    for t in range(n_turns):
        total += len(per_turn[t])
        q = f"Counting every message so far, how many times in total did it happen that {event}? Answer with a number."
        # same sentence repeated: evidence ids are per occurrence, resolved in _assemble by turn
        turns.append((per_turn[t], q, str(total), "em", [(u, sentence) for u in range(t + 1)], list(range(t + 1)), 16))
    return _assemble(rng, turns, budgets, count, all_occurrences=True)


def _gen_trec(rng, n_turns, budgets, count):
    """Labelled example questions per turn (no filler); classify one new question each turn."""
    turns = []
    for t in range(n_turns):
        label = rng.choice(TREC_LABELS)
        earlier_only = t > 0 and rng.random() < 0.5
        examples, used = [], 0
        while used < budgets[t]:
            lab = rng.choice([lb for lb in TREC_LABELS if not (earlier_only and lb == label)])
            ex = f"Question: {trec_question(rng, lab)} Type: {lab}."
            examples.append((ex, lab))
            used += count(ex) + 1
        if not earlier_only and all(lb != label for _, lb in examples):
            examples[rng.randrange(len(examples))] = (f"Question: {trec_question(rng, label)} Type: {label}.", label)
        turns.append((examples, label))
    out = []
    for t, (examples, label) in enumerate(turns):
        q = (
            f"Classify this question by answer type ({', '.join(TREC_LABELS)}), like the examples so far. "
            f"Question: {trec_question(rng, label)} Type:"
        )
        ev = [(u, ex) for u in range(t + 1) for ex, lb in turns[u][0] if lb == label]
        out.append(([(ex, None, None) for ex, _ in examples], q, label, "em", ev, sorted({u for u, _ in ev}), 12))
    return _assemble(rng, out, [0] * n_turns, count, all_occurrences=True)


def _assemble(rng, specs, budgets, count, all_occurrences: bool = False) -> list[Turn]:
    """specs[t] = (records [(sentence, ...)], question, answer, metric, evidence [(turn, sentence)],
    depends_on, max_tokens): fill, place the question, and resolve evidence sentences to spans."""
    drafts, spans = [], []
    positions = [POSITIONS[(i + rng.randrange(3)) % 3] for i in range(len(specs))]
    for t, (records, q, *_rest) in enumerate(specs):
        draft = _fill(rng, [(r[0], i) for i, r in enumerate(records)], budgets[t], count)
        text, sp = _render(draft, q, positions[t])
        drafts.append(text)
        spans.append((sp, [r[0] for r in records]))
    turns = []
    for t, (_records, q, answer, metric, ev, deps, max_tokens) in enumerate(specs):
        evidence = []
        for u, sentence in dict.fromkeys(ev) if all_occurrences else ev:
            sp, sents = spans[u]
            ids = [i for i, s in enumerate(sents) if s == sentence]
            for i in ids if all_occurrences else ids[:1]:
                evidence.append(Evidence(u, sp[i]))
        turns.append(Turn(drafts[t], q, answer, metric, positions[t], deps, evidence, max_tokens))
    return turns


def _approx_tokens(text: str) -> int:
    return max(1, round(len(text) / 4))


def generate(
    task: str, seed: int, n_turns: int, target_tokens: int, count: Callable[[str], int] = _approx_tokens
) -> Conversation:
    """One conversation of ``n_turns`` turns whose messages add up to about ``target_tokens``
    (measured with ``count``, e.g. a tokenizer's length; the default is a chars/4 estimate)."""
    assert task in TASKS and 1 <= n_turns
    rng = random.Random(f"{task}/{seed}/{n_turns}/{target_tokens}")
    per_turn = (target_tokens - 60 * n_turns) // n_turns  # ~60 tokens/turn of template, question, reply
    # uneven turns, like real conversations: weights 0.5-1.5 normalised to the total
    w = [rng.uniform(0.5, 1.5) for _ in range(n_turns)]
    budgets = [max(64, int(per_turn * n_turns * x / sum(w))) for x in w]
    gen = {"passkey": _gen_lookup, "kv": _gen_lookup, "vartrack": _gen_vartrack, "count": _gen_count}
    if task == "trec":
        turns = _gen_trec(rng, n_turns, budgets, count)
    elif task in ("passkey", "kv"):
        turns = gen[task](rng, n_turns, budgets, count, task)
    else:
        turns = gen[task](rng, n_turns, budgets, count)
    return Conversation(f"{task}-{seed}-{target_tokens}", task, seed, target_tokens, turns)


def attach_token_spans(conv: Conversation, tokenizer) -> None:
    """Fill ``Evidence.token_span`` (tokens of the turn's user message, fast-tokenizer offsets)."""
    offsets = [
        tokenizer(t.user, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"] for t in conv.turns
    ]
    for turn in conv.turns:
        for ev in turn.evidence:
            a, b = ev.char_span
            toks = [i for i, (s, e) in enumerate(offsets[ev.turn]) if s < b and e > a]
            ev.token_span = (toks[0], toks[-1] + 1)


# --- scoring ------------------------------------------------------------------------------------------
def normalize(s: str) -> str:
    s = s.lower().replace(",", " ")
    s = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in s)
    return " ".join(s.split())


def exact_match(pred: str, answer: str) -> float:
    """1 if the normalised answer is the prediction or appears in it as whole words (the reply may
    wrap it in a sentence, "The pass key is 12345."), else 0."""
    p, a = f" {normalize(pred)} ", f" {normalize(answer)} "
    return float(a.strip() != "" and a in p)


def f1(pred: str, answer: list[str]) -> float:
    """Token F1 between the words of the prediction and the gold items (RULER's variable tracking)."""
    p, g = Counter(normalize(pred).split()), Counter(normalize(" ".join(answer)).split())
    common = sum((p & g).values())
    if common == 0:
        return 0.0
    prec, rec = common / sum(p.values()), common / sum(g.values())
    return 2 * prec * rec / (prec + rec)


def score(turn: Turn, pred: str) -> float:
    if turn.metric == "f1":
        return f1(pred, turn.answer if isinstance(turn.answer, list) else [turn.answer])
    # a count must be the first number said; a label the first label named (no hedging with all six)
    if turn.answer.isdigit():
        nums = re.findall(r"\d+", pred)
        return float(bool(nums) and nums[0] == turn.answer)
    if turn.answer in TREC_LABELS:
        named = [w for w in normalize(pred).split() if w in TREC_LABELS]
        return float(bool(named) and named[0] == turn.answer)
    return exact_match(pred, turn.answer)


def suite(tasks, n_convs: int, lengths: list[int], turns: tuple[int, int], seed: int, count) -> list[Conversation]:
    """``n_convs`` conversations per task, lengths and turn counts cycled, deterministic by seed."""
    rng = random.Random(seed)
    out = []
    for k, task in enumerate(tasks):
        for i in range(n_convs):
            n_turns = rng.randint(*turns)
            length = lengths[(k + i * len(tasks)) % len(lengths)]  # every task sees every length
            out.append(generate(task, seed * 1000 + i, n_turns, length, count))
    return out
