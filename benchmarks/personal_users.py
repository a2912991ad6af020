"""Generated users for the nightly-personalization workload: a few hundred notes each, tagged with private tags.

Every user writes about the same kinds of things (family, money, car, health, work, shopping, home, travel) but
files them under their own words ("kin", "dosh", ...), has their own people, car and employer, and keeps only some
topics. So a base model cannot know the tags, one shared adapter learns a mix of everyone's, and a personal adapter is
the only one that can be right: the built-in dataset's situation, larger and for several users. Deterministic per
(user index, seed).
"""

from __future__ import annotations

import random

TOPICS = {
    "family": ["Call {person} on Sunday about {event}", "{person}'s {event} is next week, book a table",
               "pick up {person} from the station at {time}", "send {person} the photos from {event}",
               "remind {person} about the {event} plans", "{person} needs a lift to {event} on {day}"],
    "money": ["transfer {amount} to savings before {day}", "rent of {amount} goes out on {date}",
              "check the {bank} statement for the {amount} charge", "split the {amount} bill with {person}",
              "tax return due on {date}, gather receipts", "cancel the {amount} subscription at {bank}"],
    "car": ["{car} service booked for {day} at {time}", "tyre pressure warning on the {car} again",
            "renew the {car} insurance before {date}", "fill up the {car} before the trip on {day}",
            "{car} MOT due on {date}", "wash the {car} and vacuum the seats"],
    "health": ["dentist on {day} at {time}", "pick up the prescription from the pharmacy on {day}",
               "book a blood test before {date}", "physio exercises twice a day this week",
               "GP appointment {day} {time} about the knee", "run 5k on {day} morning"],
    "work": ["prepare the {employer} quarterly slides by {day}", "1:1 with my manager at {employer} on {day}",
             "submit the {employer} expenses of {amount}", "{employer} all-hands on {date} at {time}",
             "review the {employer} contract draft before {day}", "email {person} at {employer} about the deadline"],
    "shopping": ["buy milk, eggs and bread on the way home", "order a birthday present for {person}",
                 "return the shoes to the shop before {date}", "get batteries and a light bulb on {day}",
                 "groceries for {event}: wine, cheese, crackers", "new phone case, around {amount}"],
    "home": ["boiler engineer coming {day} at {time}", "fix the leaking tap in the bathroom",
             "bins go out on {day} night", "repaint the hallway before {event}",
             "landlord inspection on {date}", "water the plants while {person} is away"],
    "travel": ["flights to {city} on {date}, check in online", "book a hotel in {city} for {event}",
               "renew the passport before the {city} trip", "train to {city} on {day} at {time}",
               "pack chargers and adapters for {city}", "airport taxi at {time} on {day}"],
}  # fmt: skip
TAG_POOL = [
    "kin",
    "dosh",
    "wheels",
    "body",
    "grind",
    "haul",
    "nest",
    "roam",
    "folks",
    "coin",
    "motor",
    "care",
    "desk",
    "errand",
    "den",
    "trip",
    "clan",
    "cash",
    "garage",
    "doc",
    "job",
    "shop",
    "house",
    "away",
]
PEOPLE = ["mum", "dad", "Grandma Rose", "Aunt Liz", "Sam", "Priya", "Tom", "Nadia", "Uncle Joe", "Mia", "Ben", "Ola"]
CARS = ["Corolla", "Golf", "Fiesta", "Clio", "Civic", "Model 3", "Polo", "Octavia"]
EMPLOYERS = ["Acme", "the bakery", "Northwind", "the clinic", "Globex", "the school", "Initech", "the studio"]
CITIES = ["Lisbon", "Leeds", "Berlin", "Krakow", "Dublin", "Porto", "Vienna", "Glasgow", "Milan", "Oslo"]
EVENTS = ["birthday lunch", "anniversary", "wedding", "christening", "barbecue", "graduation", "housewarming"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
BANKS = ["Monzo", "Barclays", "the credit union", "Revolut", "HSBC"]


def generate_user(index: int, items: int, seed: int = 0, topics: int = 6) -> list[dict]:
    """`items` notes of one generated user, as {"text", "label"} in a random (time) order."""
    rng = random.Random(f"{seed}:{index}")
    kept = rng.sample(sorted(TOPICS), topics)
    tags = dict(zip(kept, rng.sample(TAG_POOL, topics)))
    slots = {
        "person": rng.sample(PEOPLE, 4), "car": rng.sample(CARS, 1), "employer": rng.sample(EMPLOYERS, 1),
        "city": rng.sample(CITIES, 3), "event": rng.sample(EVENTS, 3), "bank": rng.sample(BANKS, 2),
    }  # fmt: skip
    notes = []
    for _ in range(items):
        topic = rng.choice(kept)
        text = rng.choice(TOPICS[topic]).format(
            **{name: rng.choice(values) for name, values in slots.items()},
            day=rng.choice(DAYS), time=f"{rng.randint(7, 19)}:{rng.choice(['00', '15', '30', '45'])}",
            date=f"{rng.randint(1, 28)} {rng.choice(MONTHS)}", amount=f"£{rng.randint(5, 900)}",
        )  # fmt: skip
        notes.append({"text": text, "label": tags[topic]})
    return notes
