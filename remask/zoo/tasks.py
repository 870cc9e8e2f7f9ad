"""A seeded generator of short prompt → answer problems with checkable answers.

Every problem has a task name, a prompt, the set of answers that count as correct, and one
`target` (the answer a training example uses). Most tasks have a single answer; `colour` and
`animal` have several valid multi-letter answers whose letters depend on each other
("blue" / "black" / "brown"): a sampler that commits many positions of such an answer at once
mixes them ("bluck"), so these tasks make the cost of parallel decoding visible.

Streams are reproducible: `problems(n, seed)` always returns the same list. The training script
draws from seed `TRAIN_SEED`; held-out evaluation sets use `EVAL_SEED` (same generator, another
seed). Tasks with a small space (a one-digit sum, a capital) necessarily repeat between the two.

    >>> from remask.zoo.tasks import problems
    >>> [(p.task, p.prompt, p.answers) for p in problems(2, seed=5, tasks=("sort", "add"))]
    [('sort', 'sort 458073', ('034578',)), ('add', '0+2', ('2',))]
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable, Sequence

TRAIN_SEED = 0
EVAL_SEED = 1_000_003
MAX_ANSWER_CHARS = 15   # answers fit the default 16-position generation with at least one EOS

COLOURS = ("red", "blue", "green", "black", "white", "brown", "pink", "grey")
ANIMALS = ("cat", "dog", "cow", "fox", "owl", "bat", "pig", "hen")
NAMES = ("Ada", "Alan", "Anna", "Ben", "Carl", "Dora", "Emil", "Eva", "Finn", "Grace", "Hugo", "Ida",
         "Jan", "Kim", "Lea", "Lou", "Mia", "Nils", "Olga", "Paul", "Rosa", "Sam", "Tom", "Vera", "Zoe")
CAPITALS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Peru": "Lima", "Japan": "Tokyo",
            "Egypt": "Cairo", "Kenya": "Nairobi", "Chile": "Santiago", "Norway": "Oslo", "Greece": "Athens",
            "Poland": "Warsaw", "Cuba": "Havana"}


@dataclass(frozen=True)
class Problem:
    task: str
    prompt: str
    answers: tuple[str, ...]   # every answer that counts as correct
    target: str                # the one a training example uses (a random member of `answers`)

    def is_correct(self, text: str) -> bool:
        return text in self.answers


def _sort(rng: random.Random) -> tuple[str, tuple[str, ...], str]:
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(4, 6)))
    answer = "".join(sorted(digits))
    return f"sort {digits}", (answer,), answer


def _reverse(rng: random.Random) -> tuple[str, tuple[str, ...], str]:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
    return f"reverse {word}", (word[::-1],), word[::-1]


def _add(rng: random.Random) -> tuple[str, tuple[str, ...], str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a}+{b}", (str(a + b),), str(a + b)


def _greet(rng: random.Random) -> tuple[str, tuple[str, ...], str]:
    name = rng.choice(NAMES)
    return f"greet {name}", (f"Hello, {name}!",), f"Hello, {name}!"


def _capital(rng: random.Random) -> tuple[str, tuple[str, ...], str]:
    country = rng.choice(sorted(CAPITALS))
    return f"capital of {country}", (CAPITALS[country],), CAPITALS[country]


def _colour(rng: random.Random) -> tuple[str, tuple[str, ...], str]:
    return "name a colour", COLOURS, rng.choice(COLOURS)


def _animal(rng: random.Random) -> tuple[str, tuple[str, ...], str]:
    return "name an animal", ANIMALS, rng.choice(ANIMALS)


TASKS: dict[str, Callable[[random.Random], tuple[str, tuple[str, ...], str]]] = {
    "sort": _sort, "reverse": _reverse, "add": _add, "greet": _greet, "capital": _capital,
    "colour": _colour, "animal": _animal,
}
MULTI_ANSWER_TASKS = ("colour", "animal")
# Training mixture: the algorithmic tasks (sort, reverse) need far more examples than the lookups
# (greet, capital, a one-digit sum, the multi-answer words), so they get most of each batch.
TRAIN_WEIGHTS = {"sort": 0.3, "reverse": 0.3, "add": 0.1, "greet": 0.08, "capital": 0.08, "colour": 0.07,
                 "animal": 0.07}


def problems(n: int, seed: int, tasks: Sequence[str] | None = None) -> list[Problem]:
    """`n` problems, tasks taken in turn (so every task is equally represented), content seeded."""
    names = tuple(TASKS) if tasks is None else tuple(tasks)
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ValueError(f"tasks must be a non-empty subset of {sorted(TASKS)}, got {list(names)}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = names[i % len(names)]
        prompt, answers, target = TASKS[task](rng)
        out.append(Problem(task, prompt, answers, target))
    return out


def draw(rng: random.Random, weights: dict[str, float] | None = None) -> Problem:
    """One problem, its task drawn with `weights` (default: the training mixture `TRAIN_WEIGHTS`)."""
    weights = TRAIN_WEIGHTS if weights is None else weights
    task = rng.choices(tuple(weights), weights=tuple(weights.values()))[0]
    prompt, answers, target = TASKS[task](rng)
    return Problem(task, prompt, answers, target)
