"""Character-level text data for the Trainer examples: the paragraphs of a Python source file
that ships with Python (nothing is downloaded), as token ids below ``VOCAB``."""
import re

VOCAB = 128


def paragraphs(path, length=64):
    """The file's paragraphs (blank-line separated), 8 to ``length`` characters, as
    ``[{"input_ids": [ids]}]`` (a character's code point, capped at ``VOCAB - 1``)."""
    text = open(path, encoding="utf-8").read()
    return [{"input_ids": [min(ord(c), VOCAB - 1) for c in p.strip()[:length]]}
            for p in re.split(r"\n\s*\n", text) if len(p.strip()) >= 8]
