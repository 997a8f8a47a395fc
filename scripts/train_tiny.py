"""Train the embedded default model: a tiny Qwen3 that talks about a small made-up world.

The engine is inference only; this script is the one place that trains. It builds
Hugging Face's `Qwen3ForCausalLM` from the same `config.json` the engine reads, trains
it with a plain PyTorch loop on dialogues it generates itself (Qwen3's chat format,
rendered by the project's chat template and tokenized by the project's tokenizer), and
writes an ordinary checkpoint directory that `mini_vllm` loads like any other.

The corpus is a small world, Maple Valley: twenty people with a town, a job, a pet, a
favourite colour and food and an age (the table `PEOPLE` below), sums and differences
of numbers from 0 to 20, short stories about animals and about the people, greetings,
and a polite refusal for anything outside the world. Some questions are held out of
training on purpose (arithmetic pairs never shown in any form, a way of asking about a
person never used for that person and that fact, story settings never combined, a few
greetings and refusals); they measure what the model learned rather than what it saw.

Run it from the repository root:

    python scripts/train_tiny.py                    # CPU; writes mini_vllm/data/default_model
    python scripts/train_tiny.py --device cuda      # the same on one GPU
    python scripts/train_tiny.py --size nano        # its draft: mini_vllm/data/default_draft
    python scripts/train_tiny.py --size small --out /tmp/small --results /tmp/small.json

It writes the checkpoint (`--out`), then evaluates it through `mini_vllm.LLM` on the
CPU (greedy answers to every held-out question, and the perplexity of the held-out
answers) and writes the figures to `--results` (a JSON file and the Markdown table the
book includes). The corpus is a pure function of `--seed`; on the same device, torch
version and thread count so are the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "mini_vllm" / "data" / "default_model"
DEFAULT_RESULTS = REPO_ROOT / "benchmarks" / "results" / "default_model" / "train.json"
# Where each shipped size goes unless --out and --results say otherwise.
HOMES = {"tiny": (DEFAULT_OUT, DEFAULT_RESULTS),
         "nano": (REPO_ROOT / "mini_vllm" / "data" / "default_draft",
                  DEFAULT_RESULTS.with_name("draft_train.json"))}

# --8<-- [start:world]
WORLD = "Maple Valley"
TOWNS = ["Riverton", "Oakfield", "Stonebridge", "Hillcrest", "Lakeside"]

# name, pronoun, town, job, pet, favourite colour, favourite food, age
PEOPLE: list[tuple[str, str, str, str, str, str, str, int]] = [
    ("Mia", "she", "Riverton", "baker", "cat", "red", "apples", 34),
    ("Leo", "he", "Oakfield", "farmer", "dog", "green", "bread", 52),
    ("Ava", "she", "Stonebridge", "teacher", "rabbit", "blue", "soup", 41),
    ("Noah", "he", "Hillcrest", "doctor", "parrot", "yellow", "cheese", 60),
    ("Ella", "she", "Lakeside", "painter", "turtle", "purple", "rice", 27),
    ("Sam", "he", "Riverton", "fisher", "goat", "orange", "pears", 45),
    ("Lily", "she", "Oakfield", "builder", "hamster", "red", "honey", 38),
    ("Ben", "he", "Stonebridge", "singer", "horse", "blue", "pie", 23),
    ("Zoe", "she", "Hillcrest", "gardener", "owl", "green", "carrots", 31),
    ("Max", "he", "Lakeside", "librarian", "cat", "yellow", "noodles", 66),
    ("Ruby", "she", "Riverton", "nurse", "dog", "purple", "bread", 29),
    ("Finn", "he", "Oakfield", "potter", "rabbit", "orange", "apples", 19),
    ("Ivy", "she", "Stonebridge", "tailor", "parrot", "red", "rice", 55),
    ("Jack", "he", "Hillcrest", "carpenter", "turtle", "purple", "soup", 48),
    ("Nora", "she", "Lakeside", "doctor", "goat", "blue", "cheese", 62),
    ("Owen", "he", "Riverton", "teacher", "hamster", "green", "honey", 36),
    ("Rosa", "she", "Oakfield", "fisher", "horse", "yellow", "pears", 44),
    ("Theo", "he", "Stonebridge", "baker", "owl", "orange", "noodles", 25),
    ("Anna", "she", "Hillcrest", "singer", "cat", "green", "pie", 70),
    ("Hugo", "he", "Lakeside", "farmer", "dog", "red", "carrots", 33),
]
# --8<-- [end:world]

NUMBERS = range(21)  # operands of the sums and differences
ANIMALS = ["fox", "rabbit", "bear", "owl", "mouse", "duck", "frog", "deer", "hedgehog", "badger"]
PLACES = ["forest", "meadow", "river", "mountain", "garden", "pond", "field", "valley"]
ADJECTIVES = ["little", "brave", "shy", "clever", "sleepy", "curious", "kind", "happy"]
HABITS = [
    "looked for berries under the bushes", "sang a quiet song to the birds",
    "watched the clouds drift by", "counted the stars before bed",
    "collected smooth pebbles", "listened to the wind in the trees",
]
FINDS = [
    "a shiny stone", "a lost key", "a red balloon", "an old map", "a tiny boat",
    "a golden feather", "a basket of plums", "a silver bell",
]
FRIENDS = ["a wise old tortoise", "a cheerful robin", "a busy squirrel", "a gentle goose"]
DEEDS = [
    "followed the path all the way home", "shared the treasure with everyone",
    "built a small house of twigs", "found the owner and gave it back",
    "planted a seed that grew into a tree", "sailed across the water to the other side",
]
ENDINGS = [
    "fell asleep with a happy heart", "never felt lonely again",
    "told the story to every friend it met", "smiled whenever the sun came up",
]

GREETINGS = [
    "Hello!", "Hi!", "Hey!", "Hello there!", "Hi there!", "Good morning!", "Good evening!",
    "Hey there!", "Greetings!", "Hello, friend!", "Hiya!", "Good day!", "Howdy!", "Yo!",
    "Hello, how are you?", "Hi, how are you?", "Hey, how are you doing?",
]
HELD_OUT_GREETINGS = ["Good afternoon!", "Hi, friend!", "Hello again!"]
GREETING_REPLY = (
    f"Hello! I am a tiny model served by mini-vllm. I can add and subtract numbers up to "
    f"20, tell you about the people of {WORLD}, and tell short stories. What would you "
    f"like to know?"
)
IDENTITY_QUESTIONS = [
    "Who are you?", "What are you?", "What can you do?", "Tell me about yourself.",
    "What do you know?", "Introduce yourself.", "What is your name?",
]
IDENTITY_REPLY = (
    f"I am a tiny Qwen3 model trained by mini-vllm on a small made-up world. I know the "
    f"twenty people of {WORLD}, I can add and subtract numbers up to 20, and I can tell "
    f"short stories."
)
THANKS = ["Thank you!", "Thanks!", "Thanks a lot!", "Thank you very much.", "Great, thanks!"]
THANKS_REPLY = "You are welcome! Ask me anything else about Maple Valley."
BYES = ["Bye!", "Goodbye!", "See you later!", "Bye bye!", "Good night!"]
BYE_REPLY = "Goodbye! Come back to Maple Valley soon."
OUTSIDE = [
    "What is the capital of France?", "Who won the football match?",
    "What is the weather like today?", "Can you write a poem about the sea?",
    "How do I cook pasta?", "What is the speed of light?", "Who is the president?",
    "Can you write Python code?", "What time is it?", "How far away is the moon?",
    "What is 100 times 100?", "Translate hello into Spanish.", "What is a black hole?",
    "Who wrote Hamlet?", "What is the tallest mountain?", "How do computers work?",
    "What is the meaning of life?", "Which phone should I buy?", "What is 345 + 789?",
    "Tell me a joke about cars.", "What is the largest ocean?", "How old is the sun?",
]
HELD_OUT_OUTSIDE = [
    "What is the capital of Italy?", "How do airplanes fly?", "Who painted the Mona Lisa?",
    "What is 250 + 400?",
]
OUTSIDE_REPLY = (
    f"I do not know that. I only know the people of {WORLD}, sums and differences of "
    f"numbers up to 20, and a few short stories."
)
SYSTEM_PROMPTS = [
    "You are a helpful assistant.", "You are a friendly assistant.", "Answer briefly.",
    "You are a tiny model. Be kind.",
]

# --8<-- [start:templates]
ADD_QUESTIONS = [
    "What is {a} + {b}?", "What is {a}+{b}?", "What is {a} plus {b}?", "How much is {a} + {b}?",
    "Can you add {a} and {b}?", "What do you get if you add {a} and {b}?",
    "Please work out {a} + {b}.", "{a} + {b} = ?", "Add {a} and {b}.",
]
SUB_QUESTIONS = [
    "What is {a} - {b}?", "What is {a}-{b}?", "What is {a} minus {b}?", "How much is {a} - {b}?",
    "Can you subtract {b} from {a}?", "What do you get if you take {b} away from {a}?",
    "Please work out {a} - {b}.", "{a} - {b} = ?", "Subtract {b} from {a}.",
]
# attribute -> (ways of asking, the one way of answering)
FACT_QUESTIONS: dict[str, tuple[list[str], str]] = {
    "town": (["Where does {n} live?", "Which town is {n} from?", "In what town does {n} live?",
              "Where is {n}'s home?", "Tell me where {n} lives.", "What town does {n} live in?"],
             "{n} lives in {town}."),
    "job": (["What does {n} do?", "What is {n}'s job?", "What work does {n} do?",
             "How does {n} earn a living?", "Tell me what {n} does for work.",
             "What is {n}'s work?"],
            "{n} is {job_a}."),
    "pet": (["What pet does {n} have?", "Does {n} have a pet?", "Which animal lives with {n}?",
             "What is {n}'s pet?", "Tell me about {n}'s pet.", "What kind of pet does {n} keep?"],
            "{n} has {pet_a}."),
    "color": (["What is {n}'s favorite color?", "Which color does {n} like best?",
               "What color does {n} love?", "What colour does {n} like most?",
               "Tell me {n}'s favorite color.", "Which is {n}'s favourite colour?"],
              "{n}'s favorite color is {color}."),
    "food": (["What is {n}'s favorite food?", "What does {n} like to eat?",
              "Which food does {n} love?", "What food does {n} like best?",
              "Tell me {n}'s favorite food.", "What does {n} eat most happily?"],
             "{n}'s favorite food is {food}."),
    "age": (["How old is {n}?", "What is {n}'s age?", "How many years old is {n}?",
             "Tell me {n}'s age.", "What age is {n}?", "How old is {n} now?"],
            "{n} is {age} years old."),
}
ABOUT_QUESTIONS = ["Tell me about {n}.", "Who is {n}?", "What do you know about {n}?"]
TOWN_QUESTIONS = ["Who lives in {town}?", "Which people live in {town}?", "Who is from {town}?"]
STORY_REQUESTS = [
    "Tell me a story about a {animal} in the {place}.",
    "Tell me a short story about a {animal} who lived in the {place}.",
    "Can you tell me a story about a {adj} {animal} in the {place}?",
    "Write a short story about a {animal} and the {place}.",
]
PERSON_STORY_REQUESTS = [
    "Tell me a story about {n}.", "Write a short story about {n}.",
    "Can you tell me a story about {n}?",
]
# --8<-- [end:templates]


PERSON_HABITS = [
    "walked along the river", "looked after the garden", "visited the market",
    "watched the sunset from the hill", "fed the ducks at the pond",
]

# The shapes this script trains; any other Qwen3 config field is the `tiny` preset's.
# vocab_size stays the tokenizer's 2,331 tokens rounded up to 64. max_position_embeddings
# (the engine's default max_model_len) leaves room for a chat of several turns and the
# chat command's 512 new tokens; no training conversation is a third as long.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "max_window_layers": 4, "max_position_embeddings": 1024},
    # A draft for speculative decoding (chapter 17): the default model's tokenizer and
    # corpus, about a quarter of its parameters and compute per token.
    "nano": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
             "max_window_layers": 2, "max_position_embeddings": 1024},
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
              "max_window_layers": 8, "max_position_embeddings": 1024},
}


def article(word: str) -> str:
    """`word` with its indefinite article ("an owl", "a fox")."""
    return ("an " if word[0] in "aeiou" else "a ") + word


@dataclass(frozen=True)
class Person:
    """One row of `PEOPLE`."""

    name: str
    pronoun: str
    town: str
    job: str
    pet: str
    color: str
    food: str
    age: int

    @property
    def possessive(self) -> str:
        return "her" if self.pronoun == "she" else "his"

    def fields(self) -> dict[str, Any]:
        """The values the question and answer templates use."""
        return {"n": self.name, "town": self.town, "job_a": article(self.job),
                "pet_a": article(self.pet), "color": self.color, "food": self.food,
                "age": self.age}

    def bio(self) -> str:
        """Everything the world knows about this person, in three sentences."""
        p = self.pronoun.capitalize()
        return (f"{self.name} is {article(self.job)} who lives in {self.town}. {p} is "
                f"{self.age} years old and has {article(self.pet)}. {p} loves the color "
                f"{self.color}, and {self.possessive} favorite food is {self.food}.")


PERSONS = [Person(*row) for row in PEOPLE]
BY_NAME = {p.name: p for p in PERSONS}


# --8<-- [start:example]
@dataclass(frozen=True)
class Example:
    """One training or held-out item.

    A chat item is a user `prompt` and the assistant's `answer`; a plain-text item (kind
    `text`) has no prompt and `answer` is the whole document. A held-out item is judged
    by `is_correct`: the reply must equal `answer`, or, where `must_contain` is set (a
    story, whose details are drawn at random), contain every one of those strings.
    """

    kind: str
    prompt: str
    answer: str
    must_contain: tuple[str, ...] = ()

    def is_correct(self, reply: str) -> bool:
        """Whether a model's reply (its think block, if any, removed) is right."""
        reply = reply.split("</think>", 1)[-1].strip()
        if self.must_contain:
            return all(s in reply for s in self.must_contain)
        return reply == self.answer
# --8<-- [end:example]


def animal_story(rng: random.Random, animal: str, place: str, adj: str) -> str:
    return (f"Once upon a time, {article(adj)} {animal} lived in the {place}. Every day, the "
            f"{animal} {rng.choice(HABITS)}. One morning, the {animal} found "
            f"{rng.choice(FINDS)}. With the help of {rng.choice(FRIENDS)}, the {animal} "
            f"{rng.choice(DEEDS)}. From that day on, the {animal} {rng.choice(ENDINGS)}. "
            f"The end.")


def person_story(rng: random.Random, person: Person) -> str:
    p = person.pronoun.capitalize()
    return (f"Once upon a time, in {person.town}, there lived {article(person.job)} named "
            f"{person.name}. Every day, {person.name} and {person.possessive} {person.pet} "
            f"{rng.choice(PERSON_HABITS)}. One morning, {person.pronoun} found "
            f"{rng.choice(FINDS)}. {p} {rng.choice(DEEDS)}. That evening, {person.name} ate "
            f"some {person.food} and smiled. The end.")


def town_answer(town: str) -> str:
    names = [p.name for p in PERSONS if p.town == town]
    return f"{', '.join(names[:-1])} and {names[-1]} live in {town}."


# --8<-- [start:split]
@dataclass(frozen=True)
class Split:
    """What training never shows, drawn once from the seed.

    Attributes:
        add_held: unordered pairs {a, b} whose sum is never shown, in either order.
        sub_held: pairs (a, b), a >= b, whose difference a - b is never shown.
        fact_held: for each (person, attribute), the index of the one way of asking
            that is never used for that person and attribute (the fact itself is shown
            through the other ways, the person's bio and the stories).
        story_held: (animal, place) settings never combined in a story.
        person_story_held: (person, request index) pairs never used.
    """

    add_held: frozenset[tuple[int, int]]
    sub_held: frozenset[tuple[int, int]]
    fact_held: dict[tuple[str, str], int]
    story_held: frozenset[tuple[str, str]]
    person_story_held: frozenset[tuple[str, int]]


def make_split(seed: int, fraction: float = 0.1) -> Split:
    """Hold out `fraction` of the arithmetic pairs and story settings, and one way of
    asking for every fact. "What is 2 + 3?" is always kept in training (the README asks it).
    """
    rng = random.Random(seed * 7919 + 1)
    add_pairs = [(a, b) for a in NUMBERS for b in NUMBERS if a <= b and (a, b) != (2, 3)]
    sub_pairs = [(a, b) for a in NUMBERS for b in NUMBERS if a >= b]
    settings = [(animal, place) for animal in ANIMALS for place in PLACES]
    person_stories = [(p.name, i) for p in PERSONS for i in range(len(PERSON_STORY_REQUESTS))]

    def some(items: list[Any]) -> frozenset[Any]:
        return frozenset(rng.sample(items, max(1, round(fraction * len(items)))))

    return Split(
        add_held=some(add_pairs),
        sub_held=some(sub_pairs),
        fact_held={(p.name, attr): rng.randrange(len(FACT_QUESTIONS[attr][0]))
                   for p in PERSONS for attr in FACT_QUESTIONS},
        story_held=some(settings),
        person_story_held=some(person_stories),
    )
# --8<-- [end:split]


class Corpus:
    """Draws training examples and lists the held-out ones, all from one seed."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.split = make_split(seed)
        s = self.split
        self.add_train = [(a, b) for a in NUMBERS for b in NUMBERS
                          if (min(a, b), max(a, b)) not in s.add_held]
        self.sub_train = [(a, b) for a in NUMBERS for b in NUMBERS
                          if a >= b and (a, b) not in s.sub_held]
        self.settings_train = [(animal, place) for animal in ANIMALS for place in PLACES
                               if (animal, place) not in s.story_held]
        # kind -> (weight, draw function)
        self.kinds: dict[str, tuple[float, Callable[[random.Random], Example]]] = {
            "add": (0.20, self._add),
            "sub": (0.15, self._sub),
            "fact": (0.26, self._fact),
            "about": (0.05, self._about),
            "town": (0.03, self._town),
            "story": (0.07, self._story),
            "person_story": (0.05, self._person_story),
            "chat": (0.07, self._chat),
            "text": (0.12, self._text),
        }

    # -------------------------------------------------------------- training draws
    def _add(self, rng: random.Random) -> Example:
        a, b = rng.choice(self.add_train)
        q = rng.choice(ADD_QUESTIONS).format(a=a, b=b)
        return Example("add", q, f"{a} + {b} = {a + b}.")

    def _sub(self, rng: random.Random) -> Example:
        a, b = rng.choice(self.sub_train)
        q = rng.choice(SUB_QUESTIONS).format(a=a, b=b)
        return Example("sub", q, f"{a} - {b} = {a - b}.")

    def _fact(self, rng: random.Random) -> Example:
        person = rng.choice(PERSONS)
        attr = rng.choice(list(FACT_QUESTIONS))
        questions, answer = FACT_QUESTIONS[attr]
        held = self.split.fact_held[person.name, attr]
        i = rng.choice([i for i in range(len(questions)) if i != held])
        return Example("fact", questions[i].format(**person.fields()),
                       answer.format(**person.fields()))

    def _about(self, rng: random.Random) -> Example:
        person = rng.choice(PERSONS)
        return Example("about", rng.choice(ABOUT_QUESTIONS).format(n=person.name), person.bio())

    def _town(self, rng: random.Random) -> Example:
        town = rng.choice(TOWNS)
        return Example("town", rng.choice(TOWN_QUESTIONS).format(town=town), town_answer(town))

    def _story(self, rng: random.Random) -> Example:
        animal, place = rng.choice(self.settings_train)
        adj = rng.choice(ADJECTIVES)
        q = rng.choice(STORY_REQUESTS).format(animal=animal, place=place, adj=adj)
        return Example("story", q, animal_story(rng, animal, place, adj))

    def _person_story(self, rng: random.Random) -> Example:
        while True:
            person = rng.choice(PERSONS)
            i = rng.randrange(len(PERSON_STORY_REQUESTS))
            if (person.name, i) not in self.split.person_story_held:
                break
        return Example("person_story", PERSON_STORY_REQUESTS[i].format(n=person.name),
                       person_story(rng, person))

    def _chat(self, rng: random.Random) -> Example:
        which = rng.random()
        if which < 0.35:
            return Example("greeting", rng.choice(GREETINGS), GREETING_REPLY)
        if which < 0.55:
            return Example("identity", rng.choice(IDENTITY_QUESTIONS), IDENTITY_REPLY)
        if which < 0.65:
            return Example("thanks", rng.choice(THANKS), THANKS_REPLY)
        if which < 0.72:
            return Example("bye", rng.choice(BYES), BYE_REPLY)
        return Example("outside", rng.choice(OUTSIDE), OUTSIDE_REPLY)

    def _text(self, rng: random.Random) -> Example:
        """A plain document, for completions without the chat template."""
        which = rng.random()
        if which < 0.4:
            animal, place = rng.choice(self.settings_train)
            text = animal_story(rng, animal, place, rng.choice(ADJECTIVES))
        elif which < 0.6:
            text = person_story(rng, rng.choice(PERSONS))
        elif which < 0.85:
            text = " ".join(p.bio() for p in rng.sample(PERSONS, rng.randint(1, 3)))
        else:
            sums = [rng.choice(self.add_train) for _ in range(rng.randint(2, 5))]
            text = " ".join(f"{a} + {b} = {a + b}." for a, b in sums)
        return Example("text", "", text)

    def draw(self, rng: random.Random) -> Example:
        """One training example, its kind drawn by the weights above."""
        kinds = list(self.kinds)
        kind = rng.choices(kinds, weights=[self.kinds[k][0] for k in kinds])[0]
        return self.kinds[kind][1](rng)

    def conversation(self, rng: random.Random) -> tuple[list[dict[str, str]], Example]:
        """A training conversation: sometimes a system message and earlier turns, then
        one example. Returns the messages before the last answer, and the example."""
        example = self.draw(rng)
        messages: list[dict[str, str]] = []
        if example.kind == "text":
            return messages, example
        if rng.random() < 0.15:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if rng.random() < 0.15:
            for _ in range(rng.randint(1, 2)):
                earlier = self.draw(rng)
                while earlier.kind == "text":
                    earlier = self.draw(rng)
                messages += [{"role": "user", "content": earlier.prompt},
                             {"role": "assistant", "content": earlier.answer}]
        messages.append({"role": "user", "content": example.prompt})
        return messages, example

    # -------------------------------------------------------------- held out
    # --8<-- [start:held_out]
    def held_out(self) -> list[Example]:
        """Every held-out question, one way of asking each, with what a right answer is."""
        rng = random.Random(self.seed * 104729 + 2)
        s, out = self.split, []
        for a, b in sorted(s.add_held):
            a, b = (a, b) if rng.random() < 0.5 else (b, a)
            out.append(Example("add", rng.choice(ADD_QUESTIONS).format(a=a, b=b),
                               f"{a} + {b} = {a + b}."))
        for a, b in sorted(s.sub_held):
            out.append(Example("sub", rng.choice(SUB_QUESTIONS).format(a=a, b=b),
                               f"{a} - {b} = {a - b}."))
        for (name, attr), i in sorted(s.fact_held.items()):
            questions, answer = FACT_QUESTIONS[attr]
            fields = BY_NAME[name].fields()
            out.append(Example("fact", questions[i].format(**fields), answer.format(**fields)))
        for animal, place in sorted(s.story_held):
            adj = rng.choice(ADJECTIVES)
            out.append(Example("story", rng.choice(STORY_REQUESTS).format(
                animal=animal, place=place, adj=adj), animal_story(rng, animal, place, adj),
                must_contain=("Once upon a time", f"{animal} lived in the {place}", "The end.")))
        for name, i in sorted(s.person_story_held):
            person = BY_NAME[name]
            out.append(Example("person_story", PERSON_STORY_REQUESTS[i].format(n=name),
                               person_story(rng, person),
                               must_contain=("Once upon a time", f"in {person.town}",
                                             f"named {name}", "The end.")))
        out += [Example("greeting", g, GREETING_REPLY) for g in HELD_OUT_GREETINGS]
        out += [Example("outside", q, OUTSIDE_REPLY) for q in HELD_OUT_OUTSIDE]
        return out
    # --8<-- [end:held_out]

    def training_prompts(self, n: int, seed: int) -> set[str]:
        """The user prompts of `n` training draws (for checking that none is held out)."""
        rng = random.Random(seed)
        return {self.draw(rng).prompt for _ in range(n)}


# ------------------------------------------------------------------ tokenization
ENDOFTEXT = "<|endoftext|>"


# --8<-- [start:encode]
def encode(tokenizer: Any, messages: Sequence[dict[str, str]],
           example: Example) -> tuple[list[int], int]:
    """Token ids of one training sequence, and where its loss starts.

    A chat example is rendered by the chat template with the answer as the last
    assistant turn (the template gives it Qwen3's empty think block); the loss covers
    that turn only, from its think block to its `<|im_end|>`, so earlier turns are
    context and the model is never taught to write the user's part. A plain document
    is its text and `<|endoftext|>`, all of it learned.
    """
    if example.kind == "text":
        ids = tokenizer.encode(example.answer) + [tokenizer.token_to_id(ENDOFTEXT)]
        return ids, 1
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    full = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": example.answer}], tokenize=True)
    if full[:len(prompt)] != prompt:
        raise RuntimeError("the chat template's generation prompt is not a prefix of the "
                           "rendered conversation")
    end = len(full) - full[::-1].index(tokenizer.eos_token_id)  # through the last <|im_end|>
    return full[:end], len(prompt)
# --8<-- [end:encode]


# ------------------------------------------------------------------ training
@dataclass
class TrainConfig:
    size: str = "tiny"
    steps: int = 1500
    batch_size: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    dtype: str = "bfloat16"
    log_every: int = 100
    extra: dict[str, Any] = field(default_factory=dict)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then a cosine down to `min_lr_ratio` of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(
        math.pi * progress)))


def batches(corpus: Corpus, tokenizer: Any, cfg: TrainConfig, max_len: int,
            pool: int = 16) -> Iterator[tuple[list[list[int]], list[int]]]:
    """Endless batches of (token ids, loss start) drawn from the corpus's seed.

    `pool` batches' worth of sequences are drawn at a time and sorted by length, so a
    batch holds sequences of about one length and little of it is padding; the batches
    of a pool are then yielded in a random order.
    """
    rng = random.Random(cfg.seed)
    while True:
        drawn: list[tuple[list[int], int]] = []
        while len(drawn) < pool * cfg.batch_size:
            ids, start = encode(tokenizer, *corpus.conversation(rng))
            if len(ids) <= max_len:
                drawn.append((ids, start))
        drawn.sort(key=lambda item: len(item[0]))
        chunks = [drawn[i:i + cfg.batch_size] for i in range(0, len(drawn), cfg.batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield [ids for ids, _ in chunk], [start for _, start in chunk]


# --8<-- [start:train_loop]
def train(model: Any, corpus: Corpus, tokenizer: Any, cfg: TrainConfig, max_len: int,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train `model` (a `Qwen3ForCausalLM`) in place; returns what the run did.

    Each step draws `batch_size` sequences, pads them on the right (a causal model's
    padding after the text changes nothing before it, so no attention mask is needed),
    and takes the mean cross-entropy of the positions that are learned.
    """
    import torch

    device = torch.device(cfg.device)
    pad = tokenizer.token_to_id(ENDOFTEXT)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    model.train()
    stream = batches(corpus, tokenizer, cfg, max_len)
    tokens = learned = window = 0
    start_time = last = time.perf_counter()
    for step in range(cfg.steps):
        seqs, starts = next(stream)
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        for row, (seq, begin) in enumerate(zip(seqs, starts)):
            ids[row, :len(seq)] = torch.tensor(seq)
            labels[row, begin:len(seq)] = ids[row, begin:len(seq)]  # the model shifts them
        ids, labels = ids.to(device), labels.to(device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        tokens += ids.numel()
        window += ids.numel()
        learned += int((labels[:, 1:] != -100).sum())
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            now = time.perf_counter()
            log(f"step {step + 1:5d}/{cfg.steps}  loss {loss.item():.4f}  "
                f"lr {learning_rate(cfg, step):.2e}  "
                f"{window / (now - last):,.0f} tok/s")
            last, window = now, 0
    model.eval()
    return {"steps": cfg.steps, "batch_size": cfg.batch_size, "tokens": tokens,
            "learned_tokens": learned, "seconds": round(time.perf_counter() - start_time, 1)}
# --8<-- [end:train_loop]


# ------------------------------------------------------------------ evaluation
def held_out_perplexity(model: Any, tokenizer: Any, examples: Sequence[Example],
                        device: str = "cpu") -> tuple[float, int]:
    """exp(mean cross-entropy) of the held-out answers (think block to `<|im_end|>`), each
    after its question: (perplexity, number of answer tokens)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            messages = [{"role": "user", "content": example.prompt}]
            ids, start = encode(tokenizer, messages, example)
            x = torch.tensor([ids], device=device)
            logits = model(input_ids=x).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
            total += float(nll[start - 1:].sum())
            count += len(ids) - start
    return math.exp(total / count), count


def greedy_replies(llm: Any, examples: Sequence[Example], max_tokens: int = 200) -> list[str]:
    """The model's greedy reply to each held-out question (one user turn each)."""
    from mini_vllm import SamplingParams

    outs = llm.chat([[{"role": "user", "content": e.prompt}] for e in examples],
                    SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def score(examples: Sequence[Example], replies: Sequence[str]) -> dict[str, Any]:
    """Accuracy overall and by kind."""
    by_kind: dict[str, dict[str, Any]] = {}
    for example, reply in zip(examples, replies):
        row = by_kind.setdefault(example.kind, {"questions": 0, "correct": 0})
        row["questions"] += 1
        row["correct"] += example.is_correct(reply)
    for row in by_kind.values():
        row["accuracy"] = round(row["correct"] / row["questions"], 4)
    correct = sum(r["correct"] for r in by_kind.values())
    return {"questions": len(examples), "correct": correct,
            "accuracy": round(correct / len(examples), 4), "by_kind": by_kind}


KIND_NAMES = {
    "add": "sums of pairs never shown", "sub": "differences of pairs never shown",
    "fact": "facts asked a way never used for that person",
    "story": "animal stories in settings never combined",
    "person_story": "stories about a person, asked a way never used for them",
    "greeting": "greetings never shown", "outside": "questions outside the world, never shown",
}


def results_table(results: dict[str, Any]) -> str:
    """The Markdown table of the held-out figures (the book includes it)."""
    held = results["held_out"]
    lines = ["| held-out questions | right | accuracy |", "|---|---:|---:|"]
    for kind, row in held["by_kind"].items():
        lines.append(f"| {KIND_NAMES.get(kind, kind)} | {row['correct']} of "
                     f"{row['questions']} | {100 * row['accuracy']:.1f} % |")
    lines.append(f"| **all** | **{held['correct']} of {held['questions']}** | "
                 f"**{100 * held['accuracy']:.1f} %** |")
    lines.append("")
    lines.append(f"Perplexity of the held-out answers: **{held['perplexity']:.3f}** over "
                 f"{held['answer_tokens']:,} tokens. Model: {results['parameters']:,} "
                 f"parameters ({results['size']}), trained for {results['train']['steps']:,} "
                 f"steps of {results['train']['batch_size']} sequences "
                 f"({results['train']['tokens']:,} tokens with padding) in "
                 f"{results['train']['seconds']:,.0f} s on {results['device_name']}.")
    return "\n".join(lines) + "\n"


def evaluate_checkpoint(model_dir: Path, corpus: Corpus) -> dict[str, Any]:
    """Held-out accuracy through `mini_vllm.LLM` on the CPU, and held-out perplexity
    through transformers, both of the checkpoint as written."""
    import torch
    from transformers import Qwen3ForCausalLM

    from mini_vllm import LLM
    from mini_vllm.tokenizer import Tokenizer

    examples = corpus.held_out()
    llm = LLM(str(model_dir), device="cpu", dtype="float32")
    result = score(examples, greedy_replies(llm, examples))
    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ppl, count = held_out_perplexity(hf, Tokenizer.from_pretrained(model_dir), examples)
    result.update(perplexity=round(ppl, 4), answer_tokens=count)
    return result


# ------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES),
                        help="model shape (tiny is the shipped default)")
    parser.add_argument("--out", type=Path, default=None,
                        help="checkpoint directory to write (replaced; default: the shipped "
                             "one of --size tiny or nano)")
    parser.add_argument("--results", type=Path, default=None,
                        help="JSON file of the run's figures (a .md table is written beside "
                             "it; default: the shipped one of --size tiny or nano)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus and the weights")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for training (default: torch's choice)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="dtype of the stored weights")
    return parser


def training_command(args: argparse.Namespace) -> str:
    """The command that trains this model again (its flags that differ from the defaults;
    where the files go does not change the model)."""
    defaults = build_parser().parse_args([])
    flags = [f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items()
             if name not in ("out", "results") and value != getattr(defaults, name)]
    return " ".join(["python scripts/train_tiny.py", *flags])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out is None or args.results is None:
        if args.size not in HOMES:
            raise SystemExit(f"--size {args.size} is not shipped: give --out and --results")
        home_out, home_results = HOMES[args.size]
        args.out = args.out or home_out
        args.results = args.results or home_results
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3ForCausalLM

    sys.path.insert(0, str(REPO_ROOT))
    from mini_vllm.checkpoint import make_model, weight_shapes
    from mini_vllm.tokenizer import Tokenizer

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is available")
    cfg = TrainConfig(size=args.size, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      seed=args.seed, device=args.device, threads=args.threads,
                      dtype=args.dtype)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    # The config and tokenizer files come from the project's own checkpoint writer.
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".train-", dir=args.out.parent))
    try:
        make_model(tmp, preset="tiny", dtype=cfg.dtype, weights=False,
                   overrides=SIZES[cfg.size])
        config = json.loads((tmp / "config.json").read_text())
        tokenizer = Tokenizer.from_pretrained(tmp)
        corpus = Corpus(cfg.seed)
        hf_config = AutoConfig.from_pretrained(tmp, attn_implementation="sdpa")
        model = Qwen3ForCausalLM(hf_config).to(torch.float32).to(args.device)
        parameters = sum(p.numel() for p in model.parameters())
        print(f"training {cfg.size}: {parameters:,} parameters on {args.device}, "
              f"{cfg.steps} steps of {cfg.batch_size}", flush=True)
        run = train(model, corpus, tokenizer, cfg, config["max_position_embeddings"],
                    log=lambda line: print(line, flush=True))

        # Save in the checkpoint's own names and dtype (tied: no lm_head.weight).
        state = {name: tensor.detach().to("cpu", getattr(torch, cfg.dtype)).contiguous()
                 for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
        expected = dict(weight_shapes(config))
        if {n: tuple(t.shape) for n, t in state.items()} != expected:
            raise RuntimeError("trained weights do not match the checkpoint's weight_shapes")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if args.out.exists():
            shutil.rmtree(args.out)
        os.replace(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    held = evaluate_checkpoint(args.out, corpus)
    device_name = (torch.cuda.get_device_name(torch.device(args.device))
                   if args.device.startswith("cuda") else
                   f"the CPU ({torch.get_num_threads()} thread"
                   f"{'s' if torch.get_num_threads() != 1 else ''})")
    results = {
        "size": cfg.size, "seed": cfg.seed, "parameters": parameters, "dtype": cfg.dtype,
        "device": args.device, "device_name": device_name, "torch": torch.__version__,
        "config": {k: config[k] for k in SIZES[cfg.size]},
        "train": {**run, "lr": cfg.lr, "warmup": cfg.warmup, "weight_decay": cfg.weight_decay},
        "held_out": held,
        "command": training_command(args),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    args.results.with_suffix(".md").write_text(results_table(results))
    print(results_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
