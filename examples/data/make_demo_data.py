"""Write the demo data: preference pairs where the chosen answer is short and polite.

Every pair answers the same question with the same fact twice: the chosen answer opens
politely and says it in one sentence; the rejected one says the same fact but is rude,
rambling, or both. So what DPO can learn from it is style alone, and a model that learned it
answers held-out questions politely and briefly. Deterministic: running this script again
writes the same bytes (``python examples/data/make_demo_data.py``).

* ``demo_preferences.jsonl``: {prompt, chosen, rejected} as conversations (``prompt`` = a user
  turn, ``chosen``/``rejected`` = an assistant turn), so the model's own chat template is
  applied. The last ``HELD_OUT`` rows ask questions no earlier row asks; recipes evaluate on
  them with ``split: "train[-48:]"`` and train on ``"train[:-48]"``.
* ``demo_sft.jsonl``: {prompt, completion}: the same training questions with their chosen
  answers, for supervised fine-tuning (the held-out questions are left out).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HELD_OUT = 48  # the last rows of the file; their questions appear nowhere above them

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
    ("Brazil", "Brasília"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Greece", "Athens"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Hungary", "Budapest"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("South Korea", "Seoul"), ("India", "New Delhi"),
    ("Mexico", "Mexico City"), ("Chile", "Santiago"), ("Cuba", "Havana"), ("Turkey", "Ankara"),
    ("Russia", "Moscow"), ("China", "Beijing"), ("Morocco", "Rabat"),
]

OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"), ("early", "late"),
    ("open", "closed"), ("full", "empty"), ("strong", "weak"), ("rich", "poor"), ("young", "old"),
    ("loud", "quiet"), ("wet", "dry"), ("hard", "soft"), ("high", "low"), ("thick", "thin"),
    ("push", "pull"), ("buy", "sell"), ("win", "lose"), ("begin", "end"),
]

FACTS = [  # (question, one-sentence answer)
    ("How many days are in a week?", "There are seven days in a week."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What do bees make?", "Bees make honey."),
    ("What planet do we live on?", "We live on Earth."),
    ("What is the largest ocean on Earth?", "The Pacific is the largest ocean on Earth."),
    ("At what temperature does water boil at sea level?", "Water boils at 100 degrees Celsius at sea level."),
    ("At what temperature does water freeze?", "Water freezes at 0 degrees Celsius."),
    ("What gas do plants take in from the air?", "Plants take in carbon dioxide from the air."),
    ("What is the closest star to Earth?", "The Sun is the closest star to Earth."),
    ("How many continents are there?", "There are seven continents."),
    ("How many hours are in a day?", "There are 24 hours in a day."),
    ("How many minutes are in an hour?", "There are 60 minutes in an hour."),
    ("What is a baby cat called?", "A baby cat is called a kitten."),
    ("What is a baby dog called?", "A baby dog is called a puppy."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("What color do you get by mixing blue and yellow?", "Mixing blue and yellow gives green."),
    ("What color do you get by mixing red and white?", "Mixing red and white gives pink."),
    ("Which animal is known as the king of the jungle?", "The lion is known as the king of the jungle."),
    ("What is the tallest animal?", "The giraffe is the tallest animal."),
    ("How many sides does a triangle have?", "A triangle has three sides."),
    ("How many sides does a hexagon have?", "A hexagon has six sides."),
    ("What is the main language spoken in Brazil?", "The main language spoken in Brazil is Portuguese."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What is the largest planet in our solar system?", "Jupiter is the largest planet in our solar system."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au."),
    ("What is the chemical symbol for water?", "Water is H2O."),
    ("How many months are in a year?", "There are twelve months in a year."),
    ("What do caterpillars turn into?", "Caterpillars turn into butterflies or moths."),
    ("Which organ pumps blood through the body?", "The heart pumps blood through the body."),
    ("What is the fastest land animal?", "The cheetah is the fastest land animal."),
    ("Why is the sky blue?", "Air scatters blue sunlight more than other colors, so the sky looks blue."),
    ("Why do we have seasons?", "Earth's tilted axis changes how directly sunlight hits each place during the year."),
    ("Why do leaves change color in autumn?", "Trees stop making green chlorophyll, so the yellow and red pigments show."),
    ("How do plants make food?", "Plants use sunlight, water and carbon dioxide to make sugar by photosynthesis."),
    ("Why does ice float?", "Ice is less dense than liquid water, so it floats."),
    ("What causes rain?", "Water vapor cools into droplets in clouds, and they fall once they grow heavy."),
    ("Why do we sleep?", "Sleep lets the body recover and helps the brain store memories."),
    ("What is a computer program?", "A computer program is a list of instructions a computer follows."),
    ("What is a noun?", "A noun is a word that names a person, place, thing or idea."),
    ("What is a verb?", "A verb is a word that describes an action or a state."),
    ("How should I start learning to cook?", "Start with a few simple recipes and cook them until they feel easy."),
    ("How can I sleep better?", "Keep a regular bedtime and avoid screens for an hour before bed."),
    ("How do I make a cup of tea?", "Pour boiling water over a tea bag, wait three minutes, then remove it."),
    ("What is a good way to save money?", "Set aside a fixed amount every payday before spending anything."),
    ("How do I stay focused while studying?", "Study in short timed blocks with your phone out of reach."),
    ("How can I be more productive?", "Pick your three most important tasks each morning and do them first."),
]

POLITE_OPENERS = ["Sure! ", "Of course! ", "Happy to help! ", "Great question! ", "Certainly! "]
RUDE_OPENERS = [
    "Ugh, seriously? ", "Wow, what a dumb question. ", "Are you kidding me? ", "Fine, if I have to. ",
    "Honestly, you should know this. ",
]
RUDE_CLOSERS = [
    " Everyone knows that.", " Try using your brain next time.", " Don't ask me things this obvious again.",
    " Look it up yourself next time.", " I can't believe I had to explain that.",
]
RAMBLE_OPENERS = [
    "Well, that is a really interesting question, and before I answer it I think it is worth taking a moment "
    "to consider the broader context, because there is a lot that one could say about a topic like this. ",
    "Hmm, let me think about this for a while, because questions like this one can be approached from many "
    "different angles, and people have discussed things like this for a very long time. ",
    "So, there are a number of things to keep in mind here, and I want to make sure I cover all of them, "
    "starting from the very beginning and working my way through each of the details one by one. ",
]
RAMBLE_CLOSERS = [
    " But of course there is always more to it than that, and I could go on about it for quite a while if "
    "you wanted me to, since there are so many other related things worth mentioning as well.",
    " Anyway, that is more or less the gist of it, although to be completely fair there are plenty of other "
    "considerations and exceptions and details that I have not even started to talk about yet.",
    " I hope that makes sense, though I feel like I could keep explaining and adding more and more "
    "background for a long time, because it really is a much bigger subject than it first appears.",
]


def questions(rng: random.Random) -> list[tuple[str, str]]:
    items = [(f"What is the capital of {country}?", f"The capital of {country} is {city}.") for country, city in CAPITALS]
    items += [(f"What is the opposite of {word}?", f"The opposite of {word} is {other}.") for word, other in OPPOSITES]
    items += FACTS
    seen = set()
    while len(items) < 200:  # arithmetic fills the rest: one fact per question, exact
        a, b, op = rng.randint(2, 19), rng.randint(2, 19), rng.choice(["plus", "times", "minus"])
        if (a, b, op) in seen or (op == "minus" and a < b):
            continue
        seen.add((a, b, op))
        value = {"plus": a + b, "times": a * b, "minus": a - b}[op]
        items.append((f"What is {a} {op} {b}?", f"{a} {op} {b} is {value}."))
    return items


def rejected(fact: str, style: str, rng: random.Random) -> str:
    if style == "rude":
        return rng.choice(RUDE_OPENERS) + fact + rng.choice(RUDE_CLOSERS)
    if style == "rambling":
        return rng.choice(RAMBLE_OPENERS) + "To finally get to the point, " + fact[0].lower() + fact[1:] + rng.choice(RAMBLE_CLOSERS)
    return rng.choice(RUDE_OPENERS) + rng.choice(RAMBLE_OPENERS) + fact + rng.choice(RUDE_CLOSERS)  # both


def pairs(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    items = questions(rng)
    rng.shuffle(items)
    held_out_questions = items[:HELD_OUT]
    train_questions = items[HELD_OUT:]

    def row(question: str, fact: str) -> dict:
        return {
            "prompt": [{"role": "user", "content": question}],
            "chosen": [{"role": "assistant", "content": rng.choice(POLITE_OPENERS) + fact}],
            "rejected": [{"role": "assistant", "content": rejected(fact, rng.choice(["rude", "rambling", "both"]), rng)}],
        }

    train = [row(q, f) for _ in range(2) for q, f in train_questions]  # each training question twice, new wording
    rng.shuffle(train)
    return train + [row(q, f) for q, f in held_out_questions]


def main() -> None:
    here = Path(__file__).parent
    rows = pairs()
    write(here / "demo_preferences.jsonl", rows)
    sft = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows[:-HELD_OUT]]
    write(here / "demo_sft.jsonl", sft)
    print(f"wrote {len(rows)} pairs ({len(rows) - HELD_OUT} train, {HELD_OUT} held out) and {len(sft)} SFT rows to {here}")


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


if __name__ == "__main__":
    main()
