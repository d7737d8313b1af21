"""A deterministic multi-hop world for offline search QA: entities, relations, documents and questions.

No QA benchmark ships in a package registry, so the default data is generated: countries, cities,
universities, people, companies and films with invented names (so a retriever cannot lean on common
words), one encyclopedia-style document per entity, and 1-4 hop questions in the styles of the seven
datasets the paper uses. Every question keeps its reasoning chain (the relation hops from a seed entity),
which the oracle expert follows with real searches.

Categories (the item's sub-task) and their shapes:
  nq, triviaqa, popqa   1 hop (a fact about a named entity)
  hotpotqa              2 hops (bridge: a fact about an entity named in another's document)
  2wiki                 2 hops (comparison of two entities' years)
  musique               3 hops (bridge chains)
  bamboogle             3-4 hops (composed chains ending in a capital)
"""

from __future__ import annotations

import functools
import random
import re
import string
from dataclasses import dataclass, field

CATEGORIES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle")
PER_CATEGORY = 400  # as the paper samples 400 items per dataset
SEED = 18

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "sk",
           "t", "tr", "v", "z", "th", "st"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou"]
_CODAS = ["", "n", "r", "l", "s", "th", "m", "x", "nd", "rk"]
_OCCUPATIONS = ["painter", "physicist", "novelist", "architect", "composer", "chemist", "sculptor", "economist",
                "poet", "engineer", "historian", "botanist"]
_FILM_WORDS = ["Harbor", "Lantern", "Meadow", "Orchard", "Citadel", "Voyage", "Ember", "Glacier", "Tide",
               "Archive", "Compass", "Garden", "Mirror", "Falcon", "Canyon", "Signal"]
_FILM_ADJ = ["Silent", "Hidden", "Crimson", "Distant", "Golden", "Broken", "Quiet", "Endless", "Northern",
             "Paper", "Iron", "Velvet"]
_COMPANY_SUFFIX = ["Industries", "Systems", "Foods", "Motors", "Textiles", "Labs", "Shipping", "Records"]


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    """One QA item: the question, its gold answers, its category and the chain the oracle follows."""

    question: str
    answers: tuple[str, ...]
    category: str
    hops: int
    chain: tuple[tuple[str, str], ...] = field(default=())  # (relation, subject) steps from the seed entity
    compare: tuple[str, ...] = field(default=())  # comparison items: the entities compared


@dataclass
class World:
    countries: dict[str, dict]
    cities: dict[str, dict]
    universities: dict[str, dict]
    people: dict[str, dict]
    companies: dict[str, dict]
    films: dict[str, dict]
    documents: list[Document]
    questions: list[Question]


class _Names:
    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set()

    def word(self, syllables: int) -> str:
        while True:
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                        for _ in range(syllables))
            if len(w) >= 4 and w not in self.used:
                self.used.add(w)
                return w.capitalize()


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def build_world(seed: int = SEED, per_category: int = PER_CATEGORY) -> World:
    """The world for ``seed``: the same seed always gives the same entities, documents and questions."""
    rng = random.Random(seed)
    names = _Names(rng)
    countries = {names.word(2): {} for _ in range(24)}
    cities: dict[str, dict] = {}
    for country in countries:
        members = [names.word(2) for _ in range(4)]
        for city in members:
            cities[city] = {"country": country}
        countries[country] = {"capital": members[0], "cities": members}
    city_list = list(cities)
    universities = {f"{names.word(2)} University": {"city": rng.choice(city_list)} for _ in range(60)}
    people: dict[str, dict] = {}
    for _ in range(360):
        name = f"{names.word(2)} {names.word(2)}"
        people[name] = {"city": rng.choice(city_list), "year": rng.randrange(1900, 1991),
                        "occupation": rng.choice(_OCCUPATIONS), "university": rng.choice(list(universities))}
    person_list = list(people)
    companies = {f"{names.word(2)} {rng.choice(_COMPANY_SUFFIX)}": {
        "founder": rng.choice(person_list), "city": rng.choice(city_list), "year": rng.randrange(1920, 2011)}
        for _ in range(200)}
    films: dict[str, dict] = {}
    while len(films) < 300:
        title = f"The {rng.choice(_FILM_ADJ)} {rng.choice(_FILM_WORDS)} of {names.word(2)}"
        films[title] = {"director": rng.choice(person_list), "year": rng.randrange(1930, 2021)}
    world = World(countries, cities, universities, people, companies, films, [], [])
    world.documents = _documents(world)
    world.questions = _questions(world, random.Random(seed + 1), per_category)
    return world


def _documents(w: World) -> list[Document]:
    docs = []
    for country, c in w.countries.items():
        others = ", ".join(c["cities"][1:-1]) + f" and {c['cities'][-1]}"
        docs.append((country, f"{country} is a country. The capital of {country} is {c['capital']}. Other cities "
                              f"of {country} include {others}."))
    for city, c in w.cities.items():
        capital = f" {city} is the capital of {c['country']}." if w.countries[c["country"]]["capital"] == city else ""
        docs.append((city, f"{city} is a city in {c['country']}.{capital}"))
    for uni, u in w.universities.items():
        docs.append((uni, f"{uni} is a university located in {u['city']}."))
    for person, p in w.people.items():
        docs.append((person, f"{person} (born {p['year']}) is {_article(p['occupation'])} {p['occupation']} born "
                             f"in {p['city']}. {person} studied at {p['university']}."))
    for company, c in w.companies.items():
        docs.append((company, f"{company} is a company founded in {c['year']} by {c['founder']}. Its headquarters "
                              f"are in {c['city']}."))
    for film, f in w.films.items():
        docs.append((film, f"{film} is a {f['year']} film directed by {f['director']}."))
    return [Document(str(i), title, text) for i, (title, text) in enumerate(docs)]


# relation -> (subject kind, answer kind); the world's lookup for each is in follow()
RELATIONS = {
    "birthplace": ("person", "city"), "birth_year": ("person", "year"), "occupation": ("person", "occupation"),
    "alma_mater": ("person", "university"), "country": ("city", "country"), "capital": ("country", "city"),
    "uni_city": ("university", "city"), "founder": ("company", "person"), "headquarters": ("company", "city"),
    "founded": ("company", "year"), "director": ("film", "person"), "release": ("film", "year"),
}


def follow(w: World, relation: str, subject: str) -> str:
    """The object of ``relation`` for ``subject`` in the world (the ground truth a chain walks)."""
    table = {
        "birthplace": lambda s: w.people[s]["city"], "birth_year": lambda s: str(w.people[s]["year"]),
        "occupation": lambda s: w.people[s]["occupation"], "alma_mater": lambda s: w.people[s]["university"],
        "country": lambda s: w.cities[s]["country"], "capital": lambda s: w.countries[s]["capital"],
        "uni_city": lambda s: w.universities[s]["city"], "founder": lambda s: w.companies[s]["founder"],
        "headquarters": lambda s: w.companies[s]["city"], "founded": lambda s: str(w.companies[s]["year"]),
        "director": lambda s: w.films[s]["director"], "release": lambda s: str(w.films[s]["year"]),
    }
    return table[relation](subject)


# question templates per category: (relations of the chain, seed kind, template with {x})
_TEMPLATES: dict[str, list[tuple[tuple[str, ...], str, str]]] = {
    "nq": [(("birthplace",), "person", "where was {x} born?"),
           (("uni_city",), "university", "in which city is {x} located?"),
           (("headquarters",), "company", "where are the headquarters of {x}?")],
    "triviaqa": [(("director",), "film", "who directed the film {x}?"),
                 (("founder",), "company", "who founded {x}?"),
                 (("alma_mater",), "person", "which university did {x} attend?")],
    "popqa": [(("capital",), "country", "what is the capital of {x}?"),
              (("occupation",), "person", "what is {x}'s occupation?"),
              (("country",), "city", "in what country is {x}?")],
    "hotpotqa": [(("director", "birthplace"), "film", "in which city was the director of {x} born?"),
                 (("founder", "birth_year"), "company", "in what year was the founder of {x} born?"),
                 (("director", "alma_mater"), "film", "which university did the director of {x} attend?")],
    "musique": [(("director", "birthplace", "country"), "film", "in which country was the director of {x} born?"),
                (("founder", "alma_mater", "uni_city"), "company",
                 "in which city is the university attended by the founder of {x}?"),
                (("alma_mater", "uni_city", "country"), "person",
                 "in which country is the university that {x} attended?")],
    "bamboogle": [(("uni_city", "country", "capital"), "university",
                   "what is the capital of the country where {x} is located?"),
                  (("founder", "birthplace", "country", "capital"), "company",
                   "what is the capital of the country where the founder of {x} was born?"),
                  (("director", "birthplace", "country", "capital"), "film",
                   "what is the capital of the country in which the director of {x} was born?")],
}


def _questions(w: World, rng: random.Random, per_category: int) -> list[Question]:
    pools = {"person": list(w.people), "university": list(w.universities), "company": list(w.companies),
             "film": list(w.films), "country": list(w.countries), "city": list(w.cities)}
    out: list[Question] = []
    for category in CATEGORIES:
        seen: set[str] = set()
        count, attempts = 0, 0
        while count < per_category:
            attempts += 1
            if attempts > 50 * per_category:
                raise ValueError(f"the world is too small for {per_category} distinct {category} questions")
            if category == "2wiki":
                q = _comparison(w, rng)
            else:
                relations, kind, template = rng.choice(_TEMPLATES[category])
                seed = rng.choice(pools[kind])
                chain, subject = [], seed
                for relation in relations:
                    chain.append((relation, subject))
                    subject = follow(w, relation, subject)
                q = Question(template.format(x=seed), (subject,), category, len(relations), tuple(chain))
            if q.question not in seen:  # each question once per category
                seen.add(q.question)
                out.append(q)
                count += 1
    return out


def _comparison(w: World, rng: random.Random) -> Question:
    if rng.random() < 0.5:
        a, b = rng.sample(list(w.people), 2)
        while w.people[a]["year"] == w.people[b]["year"]:
            a, b = rng.sample(list(w.people), 2)
        first = a if w.people[a]["year"] < w.people[b]["year"] else b
        return Question(f"who was born first, {a} or {b}?", (first,), "2wiki", 2, (), (a, b))
    a, b = rng.sample(list(w.films), 2)
    while w.films[a]["year"] == w.films[b]["year"]:
        a, b = rng.sample(list(w.films), 2)
    first = a if w.films[a]["year"] < w.films[b]["year"] else b
    return Question(f"which film came out first, {a} or {b}?", (first,), "2wiki", 2, (), (a, b))


@functools.lru_cache(maxsize=4)
def default_world() -> World:
    return build_world()


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Search-R1 / SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def exact_match(prediction: str, answers: tuple[str, ...] | list[str]) -> bool:
    """Exact match after normalisation against any gold answer."""
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(a) for a in answers)
