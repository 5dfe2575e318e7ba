"""The instructions the drafts of an instruct target learn from: code tasks, structured answers and
open-ended writing, built from templates so that the set is reproducible and has a held-out part.

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
PROSE_HELD_OUT = (
    "Write a short story about a clockmaker.",
    "Write a poem about mountains.",
    "Write a paragraph explaining how bees make honey to a child.",
    "List five kinds of bread.",
    "Give a numbered list of steps to wash a car.",
    "Describe a busy market in a few sentences.",
)


def training_instructions(seed: int = 0) -> list[tuple[str, str]]:
    """(kind, instruction) pairs, shuffled by seed: 'code', 'structured' or 'writing'."""
    rows = [("code", t.format(task=task)) for task in CODE_TASKS for t in CODE_TEMPLATES]
    fill = {"things": THINGS, "activity": ACTIVITIES, "entity": ENTITIES, "choice": CHOICES}
    for t in STRUCTURED:
        key = next(k for k in fill if "{" + k + "}" in t)
        rows += [("structured", t.format(**{key: v})) for v in fill[key]]
    for t in WRITING:
        key, values = ("concept", CONCEPTS) if "{concept}" in t else ("subject", SUBJECTS)
        rows += [("writing", t.format(**{key: v})) for v in values]
    random.Random(seed).shuffle(rows)
    return rows


def held_out_code() -> list[str]:
    return [CODE_TEMPLATES[0].format(task=task) for task in CODE_HELD_OUT]


def held_out_prose() -> list[str]:
    return list(PROSE_HELD_OUT)
