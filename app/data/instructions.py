"""The instructions the drafts of an instruct target learn from: code tasks, structured answers,
open-ended writing, explanations, translation-like rewriting, summaries and second turns of a chat,
built from templates so that the set is reproducible and has a held-out part.

The target answers these itself (self-distillation), so a draft learns the text it will be asked
to predict. Held-out tasks and subjects never appear in training; the benchmark's chat suites read them.
"""

from __future__ import annotations

import random

CODE_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the vowels in a string",
    "removes duplicates from a list while keeping order",
    "flattens a nested list",
    "merges two sorted lists",
    "computes the factorial of n",
    "checks whether a string is a palindrome",
    "finds the largest element in a list",
    "returns the greatest common divisor of two integers",
    "converts Celsius to Fahrenheit",
    "counts how often each word occurs in a text",
    "sorts a list of dictionaries by a key",
    "reads a CSV file and returns its rows as dictionaries",
    "validates an email address with a regex",
    "computes the mean and standard deviation of a list",
    "transposes a matrix given as a list of lists",
    "returns the binary representation of an integer",
    "finds all anagrams of a word in a list",
    "implements binary search on a sorted list",
    "implements bubble sort",
    "implements quicksort",
    "implements merge sort",
    "checks whether brackets in a string are balanced",
    "converts a Roman numeral to an integer",
    "converts an integer to a Roman numeral",
    "returns the prime factors of a number",
    "capitalizes the first letter of every word",
    "chunks a list into pieces of size n",
    "rotates a list by k positions",
    "finds the longest common prefix of a list of strings",
    "computes the dot product of two vectors",
    "parses a key=value config file into a dictionary",
    "returns the second largest number in a list",
    "checks whether two strings are anagrams",
    "counts the lines in a text file",
    "computes the sum of the digits of a number",
    "generates all permutations of a list",
    "generates all subsets of a set",
    "computes the edit distance between two strings",
    "finds the most common element in a list",
    "converts a dictionary to a JSON string",
    "groups a list of words by their first letter",
    "checks whether a year is a leap year",
    "returns the number of days between two dates",
    "implements a stack class with push and pop",
    "implements a queue using two stacks",
    "implements a simple linked list",
    "computes the running average of a stream of numbers",
    "finds the intersection of two lists",
    "removes all whitespace from a string",
    "splits a sentence into words without punctuation",
    "computes compound interest",
    "returns the n largest items of a list",
    "deep-copies a nested dictionary",
    "retries a function call up to three times",
    "memoizes a recursive function",
    "measures how long a function takes to run",
    "walks a directory and lists all .py files",
)
CODE_TEMPLATES = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Include a docstring.",
    "Implement a function in Python that {task}, and show an example call.",
    "Write a short Python program that {task}.",
)
CODE_HELD_OUT = (
    "checks whether a number is a perfect square",
    "returns the longest word in a sentence",
    "counts the uppercase letters in a string",
    "computes the median of a list of numbers",
    "converts a hexadecimal string to an integer",
    "finds the missing number in a list from 1 to n",
    "interleaves two lists",
    "returns the cumulative sum of a list",
    "checks whether a list is sorted",
    "replaces every vowel in a string with an asterisk",
)

# A larger held-out code suite, in the words a user types, never trained on: enough requests that a
# difference of 0.03 in α stands out of the interval (bench --card prints it).
CODE_SUITE = (
    "Write a Python function that returns the k most frequent characters of a string.",
    "Write a Python function is_power_of_two(n) without using loops.",
    "Write a function that converts snake_case names to camelCase.",
    "Write a Python function that returns every index at which a substring occurs in a string.",
    "Write a Python generator that yields the rows of Pascal's triangle.",
    "Write a function that checks whether a 9x9 Sudoku board given as a list of lists is valid.",
    "Write a Python function that pads a list of strings to the same length with spaces.",
    "Write a Python function that turns a list of (key, value) pairs into a dictionary of lists.",
    "Write a function that returns the run-length encoding of a string, such as 'aaab' -> 'a3b1'.",
    "Write a Python function that decodes a run-length encoded string back into the original.",
    "Write a Python function that returns the number of islands in a grid of 0s and 1s.",
    "Write a dataclass Point with x and y, and a method that returns its distance to another point.",
    "Write a Python function that merges overlapping intervals given as a list of (start, end) pairs.",
    "Write a context manager that changes the working directory and changes it back on exit.",
    "Write a Python decorator that logs each call's arguments and return value.",
    "Write a function that returns the day of the week for a date string such as '2024-03-15'.",
    "Write a Python function that truncates a text to n characters and adds '...' if it was cut.",
    "Write a Python class Counter that counts events and can report the top three.",
    "Write a function that reads a JSON file and returns the value at a dotted path such as 'a.b.c'.",
    "Write a Python function that computes the moving maximum over a window of size k.",
    "Write a function that checks whether a string is a valid IPv4 address.",
    "Write a Python function that returns the Collatz sequence starting from n.",
    "Write a function that zips two dictionaries into a dictionary of pairs for their common keys.",
    "Write a Python function that renames every .txt file in a folder to .md.",
    "Write a function that returns the nth triangular number and a test for it with assert.",
    "Write a Python function that splits a list into two lists: even and odd numbers.",
    "Write a Python function that finds the first non-repeating character in a string.",
    "Write a Python class Matrix with addition and multiplication of two matrices.",
    "Write a function that formats a number of seconds as hours, minutes and seconds.",
    "Write a Python function that checks whether a linked list has a cycle.",
    "Write a Python function that returns all pairs in a list whose sum equals a target.",
    "Write a unittest test case for a function add(a, b) that covers negatives and zero.",
    "Add type hints and a docstring to this function:\n\ndef scale(xs, f):\n    return [x * f for x in xs]",
    "Rewrite this loop as a list comprehension:\n\nout = []\nfor x in xs:\n    if x > 0:\n        out.append(x * x)",
    "This function should return the largest value but returns the smallest. Fix it:\n\n"
    "def largest(xs):\n    best = xs[0]\n    for x in xs:\n        if x < best:\n            best = x\n    return best",
    "Write a Python function that removes comments starting with # from every line of a text.",
    "Write a function that returns the longest increasing subsequence of a list of numbers.",
    "Write a Python function that counts the words in a file, ignoring case.",
    "Write an LRU cache class with get and put methods in Python.",
    "Write a Python function that returns a histogram of a list of integers as a string of stars.",
)

STRUCTURED = (
    "List five {things}.",
    "Give a numbered list of steps to {activity}.",
    "Write a JSON object describing {entity}, with a name, a short description and three tags.",
    "Make a table in Markdown comparing three {things}.",
    "Give three pros and three cons of {choice}, as bullet points.",
)
THINGS = (
    "fruits",
    "programming languages",
    "planets",
    "European capitals",
    "musical instruments",
    "kinds of trees",
    "board games",
    "sorting algorithms",
    "ocean animals",
    "famous scientists",
    "healthy breakfasts",
    "types of clouds",
    "Python libraries",
    "rivers in Africa",
    "dog breeds",
)
ACTIVITIES = (
    "make a cup of tea",
    "plant a tree",
    "learn a new language",
    "write a good essay",
    "set up a Python virtual environment",
    "bake bread",
    "prepare for an exam",
    "change a bicycle tyre",
    "start running",
    "organise a small party",
)
ENTITIES = ("a book", "a city", "a laptop", "a cat", "a movie", "a restaurant", "a park", "a song")
CHOICES = (
    "working from home",
    "electric cars",
    "learning to code",
    "living in a big city",
    "reading e-books",
    "public transport",
    "a vegetarian diet",
    "open-source software",
)

WRITING = (
    "Write a short story about {subject}.",
    "Write a poem about {subject}.",
    "Write a paragraph explaining {concept} to a child.",
    "Describe {subject} in a few sentences.",
)
SUBJECTS = (
    "the sea",
    "a lost key",
    "a robot learning to paint",
    "autumn leaves",
    "a lighthouse keeper",
    "a city at night",
    "the first snow of winter",
    "a friendly dragon",
    "a long train journey",
    "an old library",
    "the moon",
    "a garden in spring",
    "a brave little mouse",
    "the desert",
)
CONCEPTS = (
    "gravity",
    "photosynthesis",
    "how computers store numbers",
    "why the sky is blue",
    "what a recipe is",
    "how rain forms",
    "what electricity is",
    "how plants grow",
)
EXPLAIN = ("Explain {concept} in simple terms.", "What is {term}? Answer in two or three sentences.")
TERMS = (
    "a variable in programming",
    "a neural network",
    "inflation",
    "a black hole",
    "the water cycle",
    "a database",
    "recursion",
    "democracy",
    "an API",
    "compound interest",
)

# Translation-like rewriting: the answer restates the input, so most of it is predictable from the prompt.
REWRITE = (
    "Rewrite this sentence in formal English: {sentence}",
    "Translate this sentence into French: {sentence}",
    "Correct the grammar of this sentence: {sentence}",
    "Rewrite this sentence in the passive voice: {sentence}",
)
SENTENCES = (
    "the cat sat on the mat and watched the birds outside",
    "we was going to the shop but it were closed",
    "my brother fixed the old bike last summer",
    "can you send me the report by friday",
    "the children played in the park until it got dark",
    "i think this movie is really good and everyone should see it",
    "the teacher explained the lesson twice",
    "our team won the game in the last minute",
    "she don't like coffee in the morning",
    "the company will open a new office next year",
    "they painted the house blue",
    "he forgot his keys at home again",
    "the storm broke many trees in the town",
    "we need to finish this project soon",
    "the chef cooked a delicious dinner for the guests",
    "my friends and me went to the beach",
    "the students wrote an essay about climate change",
    "please tell me when the train leaves",
    "the dog chased the ball across the garden",
    "the scientists discovered a new species of frog",
)
SUMMARY = (
    "Summarize this text in one sentence: {paragraph}",
    "Give the main points of this text as a short bullet list: {paragraph}",
)
PARAGRAPHS = (
    "Bees live in colonies with a single queen. Worker bees collect nectar and pollen from flowers, "
    "and while they do so they carry pollen from plant to plant. Many crops depend on this pollination, "
    "so farmers sometimes rent hives to place near their fields.",
    "The city council voted to close the main street to cars on Sundays. Shop owners were worried at "
    "first, but after three months most of them reported more customers. Families now walk, cycle and "
    "eat outside where traffic used to be.",
    "Python is a programming language known for its readable syntax. It is used for web development, "
    "data analysis, automation and machine learning. Its large standard library and many third-party "
    "packages let programmers build useful tools quickly.",
    "Sleep helps the body repair itself and the brain store memories. Adults need about seven to nine "
    "hours a night. Screens before bed, caffeine late in the day and irregular hours can all make it "
    "harder to fall asleep.",
    "The first bicycles had no pedals: riders pushed themselves along with their feet. Pedals, chains "
    "and air-filled tyres came later and made cycling faster and more comfortable. Today bicycles are "
    "one of the most common ways to travel in many cities.",
    "A volcano forms where molten rock from deep inside the Earth reaches the surface. When pressure "
    "builds up, the volcano can erupt and throw out lava, ash and gas. Some volcanoes erupt often, while "
    "others stay quiet for thousands of years.",
    "The library started lending tools as well as books. People can now borrow drills, ladders and "
    "sewing machines for a week at a time. The service is popular with students and with people who "
    "only need a tool once.",
    "Recycling saves raw materials and energy. Paper, glass, metal and some plastics can be processed "
    "into new products. However, recycling only works well when items are clean and sorted correctly.",
    "Our team moved the weekly meeting from Monday to Wednesday. Many members said Mondays were too busy "
    "with emails from the weekend. The new day gives everyone time to prepare updates.",
    "Tomatoes grow best in warm, sunny places. They need regular watering and support from a stick or "
    "cage as they get taller. Most varieties are ready to pick about two months after planting.",
)

# Second turns of a chat: the target answers a first instruction, then this follow-up after its own answer.
FOLLOW_UPS = (
    "Can you explain that in simpler words?",
    "Now make it shorter.",
    "Can you give one more example?",
    "Please add comments to explain each step.",
    "Can you summarize your answer in one sentence?",
    "What would you change to make it better?",
)

PROSE_HELD_OUT = (
    "Write a short story about a clockmaker.",
    "Write a poem about mountains.",
    "Write a paragraph explaining how bees make honey to a child.",
    "List five kinds of bread.",
    "Give a numbered list of steps to wash a car.",
    "Describe a busy market in a few sentences.",
)

REWRITE_HELD_OUT = (
    "Translate this sentence into French: the museum opens at nine in the morning",
    "Correct the grammar of this sentence: him and his sister goes to school by bus",
    "Rewrite this sentence in formal English: the new phone is super cool and pretty cheap",
    "Rewrite this sentence in the passive voice: the wind blew the leaves across the road",
    "Summarize this text in one sentence: Owls hunt mostly at night. Their large eyes and excellent "
    "hearing help them find mice and insects in the dark, and soft feathers let them fly almost silently.",
    "Explain how a refrigerator keeps food cold in simple terms.",
)
# (first turn, follow-up): the second turn is asked after the target's own answer to the first.
CHAT_HELD_OUT = (
    ("Write a Python function that checks whether a list is sorted.", "Now make it shorter."),
    ("List five kinds of bread.", "Can you explain that in simpler words?"),
    ("Give a numbered list of steps to wash a car.", "Can you summarize your answer in one sentence?"),
    ("Write a Python function that interleaves two lists.", "Please add comments to explain each step."),
    ("Describe a busy market in a few sentences.", "Can you give one more example?"),
    ("What is a compiler? Answer in two or three sentences.", "What would you change to make it better?"),
)


def training_instructions(seed: int = 0) -> list[tuple[str, str]]:
    """(kind, instruction) pairs, shuffled by seed: 'code', 'structured', 'writing', 'explain',
    'rewrite' or 'summary'. Second turns (chat_follow_ups) are built on the target's answers to these."""
    rows = [("code", t.format(task=task)) for task in CODE_TASKS for t in CODE_TEMPLATES]
    fill = {"things": THINGS, "activity": ACTIVITIES, "entity": ENTITIES, "choice": CHOICES}
    for t in STRUCTURED:
        key = next(k for k in fill if "{" + k + "}" in t)
        rows += [("structured", t.format(**{key: v})) for v in fill[key]]
    for t in WRITING:
        key, values = ("concept", CONCEPTS) if "{concept}" in t else ("subject", SUBJECTS)
        rows += [("writing", t.format(**{key: v})) for v in values]
    rows += [("explain", EXPLAIN[0].format(concept=c)) for c in CONCEPTS]
    rows += [("explain", EXPLAIN[1].format(term=t)) for t in TERMS]
    rows += [("rewrite", t.format(sentence=s)) for s in SENTENCES for t in REWRITE]
    rows += [("summary", t.format(paragraph=p)) for p in PARAGRAPHS for t in SUMMARY]
    random.Random(seed).shuffle(rows)
    return rows


def chat_follow_ups(first_turns: list[tuple[str, str]], seed: int = 0) -> list[tuple[str, str]]:
    """(kind of the first turn, follow-up) for each first turn: the follow-ups cycle in a seeded order."""
    order = list(FOLLOW_UPS)
    random.Random(seed).shuffle(order)
    return [(kind, order[i % len(order)]) for i, (kind, _) in enumerate(first_turns)]


def held_out_code() -> list[str]:
    return [CODE_TEMPLATES[0].format(task=task) for task in CODE_HELD_OUT]


def held_out_code_suite() -> list[str]:
    """The larger held-out code suite: chat-form requests, never trained on."""
    return list(CODE_SUITE)


def held_out_prose() -> list[str]:
    return list(PROSE_HELD_OUT)


def held_out_rewrite() -> list[str]:
    """Held-out translation-like rewriting, a summary and an explanation: text close to its prompt."""
    return list(REWRITE_HELD_OUT)


def held_out_chat() -> list[tuple[str, str]]:
    """Held-out two-turn chats: (first turn, follow-up)."""
    return list(CHAT_HELD_OUT)
