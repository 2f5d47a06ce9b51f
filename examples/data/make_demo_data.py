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
    ("How can I learn a new language?", "Practise a little every day and talk with native speakers as early as you can."),
    ("How do I get better at running?", "Run three times a week and increase your distance slowly."),
    ("How can I make new friends in a new city?", "Join a club or class around something you enjoy and go regularly."),
    ("How do I write a good email?", "Say what you need in the first line and keep the rest short."),
    ("How can I remember names better?", "Repeat the name aloud when you hear it and use it once in the conversation."),
    ("How do I keep my plants alive?", "Water them when the top of the soil is dry and give them enough light."),
    ("How can I drink more water?", "Keep a filled bottle in sight and sip from it during the day."),
    ("How do I prepare for a job interview?", "Research the company and practise answering common questions aloud."),
    ("How can I reduce stress?", "Take short walks, breathe slowly and get enough sleep."),
    ("How do I start saving for a trip?", "Decide the total cost and put a fixed amount aside every week."),
    ("How do I learn to type faster?", "Practise touch typing for ten minutes a day without looking at the keys."),
    ("How can I read more books?", "Carry a book with you and read a few pages whenever you wait."),
    ("How do I clean a stained shirt?", "Rinse the stain with cold water, rub in a little soap, then wash it."),
    ("How can I get up earlier?", "Move your alarm fifteen minutes earlier each week and go to bed earlier too."),
    ("How do I make good coffee at home?", "Use freshly ground beans and water just off the boil."),
    ("How can I improve my handwriting?", "Write slowly and copy a clear model for a few minutes each day."),
    ("Why do cats purr?", "Cats purr mostly when they are content, and sometimes to calm themselves."),
    ("Why is the ocean salty?", "Rivers carry dissolved minerals into the sea, and the salt stays when water evaporates."),
    ("How does a rainbow form?", "Raindrops bend and split sunlight into its colors."),
    ("Why do birds migrate?", "Birds migrate to find food and a good place to raise their young."),
    ("What is gravity?", "Gravity is the force that pulls objects with mass toward each other."),
    ("What does a thermometer measure?", "A thermometer measures temperature."),
    ("Why do we need to exercise?", "Exercise keeps the heart, muscles and mind healthy."),
    ("How does a refrigerator keep food cold?", "It pumps heat out of the inside and releases it at the back."),
]

STYLES = ["rambling", "rambling", "rude", "both"]
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
    "Well, that is a really interesting question, and before answering it I think it is worth taking a moment "
    "to consider the broader context, because there is a lot one could say here. ",
    "Hmm, let me think about this for a while, because questions like this one can be approached from many "
    "different angles, and people have discussed them for a long time. ",
    "So, there are a number of things to keep in mind here, and I want to make sure I cover all of them, "
    "starting from the very beginning and going through the details one by one. ",
]
RAMBLE_CLOSERS = [
    " But of course there is always more to it than that, and I could go on about it for quite a while.",
    " Anyway, that is more or less the gist of it, although there are plenty of other details I have not covered.",
    " I hope that makes sense, though I could keep adding more and more background for a long time.",
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
            # mostly rambling: fluent, polite filler the base model finds likely, so it is no trivial pick
            "rejected": [{"role": "assistant", "content": rejected(fact, rng.choice(STYLES), rng)}],
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
