# ruff: noqa: RUF001  (the check set is made of characters that look like others, on purpose)
"""The built-in check set: texts a fast encoder must encode exactly as the reference library before it is used.

Chosen to reach the places where two implementations of one tokenizer part ways: many scripts,
normalization (NBSP, ligatures, full-width forms, combining marks), whitespace runs, digits,
emoji sequences, control characters, long words, and the model's own special-token strings in every
position. `texts(special)` adds those strings to the fixed ones, and runs of whitespace of many lengths before
every kind of character (`whitespace_texts`); `texts(special, pieces)` also a ranks model's tokens that are not
the merge of two others (`piece_texts`). What issue 32's round found is among them: an encoder that ignored
added-token ids (special-token strings beside text, repeated, cut, one a prefix of another), split whitespace
runs otherwise, or could not produce a token that no merge makes.

The fixed texts are a sample; the gate (tokenizer_service.core.libraries.gate) also scans every Unicode
code point (`code_point_blocks`, `edge_texts`) and every special-token string (`token_groups`), batched
into large texts so that the scan costs seconds, with each text that differs bisected down to what
differs. `VERSION` names these texts in the gate's cache: change it whenever they change.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

FIXED = (
    "",
    " ",
    "a",
    "Hello, world! This is a test.",
    "  leading and trailing spaces  ",
    "I'm sure you're right; they'll say we've done it, but it's DON'T and CAN'T and he'd.",
    "Numbers: 0 7 42 123 4567 89012 345678 3.14159 1,000,000 1e-9 -273.15 0x1F 2026-11-25 12:34:56",
    "Arabic-Indic ٠١٢٣٤٥٦٧٨٩ and Devanagari ०१२३ and full-width ０１２３ digits",
    "日本語のテキストです。東京は日本の首都です。カタカナとひらがな。",
    "中文文本，简体字。繁體中文文本，正體字。",
    "한국어 텍스트입니다. 서울은 대한민국의 수도입니다.",
    "Русский текст. Москва — столица России. Ёлка и ёж.",
    "Ελληνικά: Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "العربية: القاهرة هي عاصمة مصر.",
    "עברית: ירושלים היא בירת ישראל.",
    "ภาษาไทย: กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย",
    "हिन्दी: नई दिल्ली भारत की राजधानी है।",
    "Tiếng Việt: Hà Nội là thủ đô của Việt Nam.",
    "Deutsch: Größe, Straße, Übermäßig. Français : « déjà vu », l’œuvre, naïveté. Español: ¿Qué tal? ¡Olé!",
    "emoji 👍 👍🏽 👨‍👩‍👧‍👦 🇯🇵 🇺🇸 ❤️ 🏳️‍🌈 😀😃😄 ✨🎉",
    "combining e\u0301 a\u0308 o\u0302\u0323 Z\u0324\u0354\u0367\u0311\u0313 \u1100\u1161\u11a8",
    "web text\u00a0with\u00a0NBSP\u2026 \u201ctypographic\u201d \u2018quotes\u2019 \u2013 \u2014"
    " \ufb01le \ufb02ow \u2122 \u00bd",
    "full-width ＡＢＣ ａｂｃ ！？ half-width ｶﾀｶﾅ circled ① ② ℌ ℍ ㍿ \ufdfa",
    "whitespace runs:" + " " * 37 + "end\t\t\tTabs\n\n\n\nnewlines\r\nCRLF \u3000ideographic\u2003em",
    "\n" * 25,
    " \t \t \n \u00a0 \u2028 \u2029 ",
    "controls a\x00b\x01c\x7f d\x1be[0m \ufeffBOM \u200bzero\u200cwidth\u200djoin",
    "x" * 5000,
    "ab" * 2500,
    "supercalifragilisticexpialidocious" * 60,
    "Donaudampfschifffahrtsgesellschaftskapitänskajütentürschlossschlüssel",
    "https://example.com/path/to/page?query=value&other=1#anchor user@example.org",
    "def tokenize(texts: list[str]) -> list[int]:\n    return [len(t) for t in texts]  # comment\n\n\tif x:\n",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    '<html><body><p class="x">Paragraph</p></body></html>',
    "$$\\int_0^\\infty e^{-x^2} dx = \\frac{\\sqrt{\\pi}}{2}$$ α β γ ∑ ∏ √ ∞ ≠ ≤ ≥",
    "!!!???...,,,;;;:::---___===+++***&&&%%%$$$###@@@^^^~~~```|||\\\\\\///",
    "mIxEd CaSe WoRdS and ALLCAPS and lowercase and Title Case",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 1 2 3",
    "The quick brown fox jumps over the lazy dog. " * 20,
)


# of the texts below and the scan (5: gigatoken encodes a text a call; 6: as UTF-8 bytes; 7: pairs of added tokens,
# each code point before a space and a letter or digit): a verdict of another is not used
VERSION = 7

LONG_TOKEN_CHARS = 256  # a longer special-token string is checked alone and in one context, never repeated
TOKENS_PER_TEXT = 64  # special-token strings batched into one check text (a long one gets a text of its own)
CODE_POINTS_PER_TEXT = 256  # code points batched into one check text


PREFIX_PAIRS = 1024  # pairs of special-token strings where one begins the other, checked at most
# Added tokens side by side (`pair_texts`): every ordered pair of them with each separator where a model has at most
# ALL_PAIRS_TOKENS; else every pair in which one token has whitespace at the edge facing the other, or is one of the
# first FIRST_TOKENS; at most MOST_PAIRS pairs.
ALL_PAIRS_TOKENS = 64
FIRST_TOKENS = 16
MOST_PAIRS = 8_000
PAIR_SEPARATORS = ("", " ", "  ", "\t ", "\n ", " \n ", "\u3000 ", "\u00a0 ", "\n", "\t")
PIECES_PER_TEXT = 64  # tokens that are no merge of two, batched into one check text
PIECES = 1024  # such tokens of a model checked at most (the first by rank)

# Whitespace runs: each kind, of each length, before each kind of character, at the start and end of a text
WHITESPACE = (" ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2003", " \n", "\n ", "\t ", " \t", "\n\t", "\r\n ")
RUN_LENGTHS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 65, 128)
AFTER_RUNS = ("a", "Word", "7", "42", "1234", "!", ".", "'s", "(", "日本", "한국", "👍", "é", "-", "$", "\u00a0x")


def texts(special: Iterable[str] = (), pieces: Iterable[str] = ()) -> list[str]:
    """The fixed texts; the special-token strings alone, in words, spaced, repeated, cut and side by side
    (`token_groups`: every one of them, batched), and those that begin another one with it (`prefix_texts`);
    the whitespace runs (`whitespace_texts`); `pieces` (tokens that are no merge of two others) in context."""
    out = list(FIXED)
    tokens = [token for token in special if token]
    out += tokens
    out += [token_text(group) for group in token_groups(tokens)]
    out += prefix_texts(tokens)
    out += pair_texts(tokens)
    out += whitespace_texts()
    out += piece_texts([piece for piece in pieces if piece])
    return out


def whitespace_texts() -> list[str]:
    """Runs of whitespace (spaces, tabs, newlines, CR LF, NBSP, U+3000, mixes) of many lengths before letters,
    digits, punctuation, CJK, Hangul and emoji, starting and ending the text: one text per kind and length; then
    one per kind with every other kind after it. Where split patterns (`\\s+(?!\\S)`, `\\s*[\\r\\n]+`) and
    their reimplementations part ways."""
    out = []
    for space in WHITESPACE:
        for length in RUN_LENGTHS:
            run = space * length
            out.append(run + run.join(AFTER_RUNS) + run)
    for space in WHITESPACE:
        out.append("".join(space * 2 + other * 3 + "x" + other + space + "1 " for other in WHITESPACE))
    return out


def prefix_texts(tokens: Sequence[str]) -> list[str]:
    """For each pair of special-token strings where one begins the other (at most `PREFIX_PAIRS`), both in
    texts where the shorter one, the longer one or neither may match first: batched `TOKENS_PER_TEXT` pairs
    a text."""
    ordered = sorted({token for token in tokens if len(token) <= LONG_TOKEN_CHARS})
    pairs: list[tuple[str, str]] = []
    for index, short in enumerate(ordered):
        for long in ordered[index + 1 :]:
            if not long.startswith(short):
                break
            pairs.append((short, long))
        if len(pairs) >= PREFIX_PAIRS:
            break
    pairs = pairs[:PREFIX_PAIRS]
    return [
        "".join(
            f"{long} {short} {long}{short} {short}{long} {short}{long[len(short) : -1]} {long[:-1]}{long}x\n"
            for short, long in pairs[start : start + TOKENS_PER_TEXT]
        )
        for start in range(0, len(pairs), TOKENS_PER_TEXT)
    ]


def pair_texts(tokens: Sequence[str]) -> list[str]:
    """Added tokens side by side, with each of `PAIR_SEPARATORS` between them (none, spaces, tabs, newlines, U+3000,
    NBSP), `TOKENS_PER_TEXT` pairs a text, each pair on a line of its own after a word. Where a token that strips
    the whitespace after it (rstrip) meets one that begins with a space (" FOO"), fastokens 0.3.5 matched the second
    where `tokenizers` no longer can: pairs no single token's contexts make."""
    short = [token for token in dict.fromkeys(tokens) if len(token) <= LONG_TOKEN_CHARS]
    pairs: Iterable[tuple[str, str]]
    if len(short) <= ALL_PAIRS_TOKENS:
        pairs = itertools.product(short, short)
    else:  # in time linear in the tokens (a model may have 70,000 added tokens): never all pairs looked at
        chosen = short[:FIRST_TOKENS]
        before = list(dict.fromkeys([token for token in short if token[-1].isspace()] + chosen))  # facing the next
        after = list(dict.fromkeys([token for token in short if token[0].isspace()] + chosen))
        taken = set(before)
        pairs = itertools.chain(
            itertools.product(before, short),
            ((first, second) for first in short if first not in taken for second in after),
        )
    lines = [
        f"x {first}{separator}{second} y"
        for first, second in itertools.islice(pairs, MOST_PAIRS)
        for separator in PAIR_SEPARATORS
    ]
    return ["\n".join(lines[start : start + TOKENS_PER_TEXT]) for start in range(0, len(lines), TOKENS_PER_TEXT)]


def piece_texts(pieces: Sequence[str]) -> list[str]:
    """Tokens that are not the merge of two others (a ranks model's: tiktoken makes one only of a piece of text
    that is the whole token), alone, after a word, before punctuation, doubled, beside special-token-like text
    and on lines of their own: `PIECES_PER_TEXT` a text, each of the first `PIECES_PER_TEXT` also a text alone."""
    out = list(pieces[:PIECES_PER_TEXT])
    for start in range(0, len(pieces), PIECES_PER_TEXT):
        out.append(
            "".join(
                f"{piece} Hello{piece}, x{piece}{piece} {piece}! ({piece}) <|{piece}|>\n{piece}\n"
                for piece in pieces[start : start + PIECES_PER_TEXT]
            )
        )
    return out


def token_contexts(token: str) -> str:
    """One special-token string in the contexts where implementations part ways: inside words, spaced,
    next to other scripts and emoji, whitespace around it (where lstrip/rstrip tokens and whitespace-only
    added tokens meet), and repeated (only when short: a 256 KB special-token string must not cost more
    than a few times its size)."""
    if len(token) > LONG_TOKEN_CHARS:
        return f"a{token}b {token}\n"
    return (
        f"a{token}b {token} Hello{token}\n{token}world {token}日本語 {token}👍"
        f"  {token}  \n\t {token} \t\nx  {token}  x {token} {token} x {token * 3}\n"
        f'{token}. 1{token}2 ({token}) "{token}" 「{token}」 {token}\r\n{token}\u00a0{token}\u3000{token}'
        f"\n\n\n{token}"
        f" {token[:-1]}{token} {token}{token[1:]} {token[:-1]} {token[1:]}\n"
    )


def token_text(tokens: Sequence[str]) -> str:
    """Special-token strings each in its contexts, then side by side, two spaces apart, and each one's first
    half before the next one."""
    if len(tokens) == 1:
        return token_contexts(tokens[0])
    halves = "".join(first[: len(first) // 2] + second for first, second in itertools.pairwise(tokens))
    return "".join(token_contexts(token) for token in tokens) + "".join(tokens) + " " + "  ".join(tokens) + halves


def token_groups(tokens: Sequence[str]) -> list[list[str]]:
    """The special-token strings in groups of `TOKENS_PER_TEXT`; a long one alone."""
    groups: list[list[str]] = []
    group: list[str] = []
    for token in tokens:
        if len(token) > LONG_TOKEN_CHARS:
            groups.append([token])
            continue
        group.append(token)
        if len(group) == TOKENS_PER_TEXT:
            groups.append(group)
            group = []
    if group:
        groups.append(group)
    return groups


def code_points() -> list[int]:
    """Every Unicode code point a str can carry as text: 0 to U+10FFFF but the surrogates."""
    return [*range(0xD800), *range(0xE000, 0x110000)]


def code_point_text(points: Sequence[int]) -> str:
    """Each code point between a space and a letter, between letters and three times in a row, then before a space
    and a letter and before a space and a digit, two lines each.

    Each of these neighbourhoods (what comes before and after the code point) matters: a shorter line that
    kept the neighbours but not these pairs of them (` ccca c`) missed U+180E in cl100k_base, which fastokens
    0.3.5 takes for whitespace only between a space and a letter. And U+180E before a space and a letter or digit
    (`{c} m`, `{c} 7`) split otherwise in fastokens on a model of a Split pattern of its own (`\\s+|.`), which the
    first line never puts it in."""
    return "".join(f" {c}a{c}b{c}{c}{c}\n{c} m{c} 7\n" for c in map(chr, points))


def code_point_blocks() -> list[list[int]]:
    points = code_points()
    return [points[start : start + CODE_POINTS_PER_TEXT] for start in range(0, len(points), CODE_POINTS_PER_TEXT)]


def edge_text(point: int) -> str:
    """The code point at the start and at the end of a text."""
    c = chr(point)
    return f"{c}a{c}"


def describe(points: Iterable[int], most: int = 64) -> str:
    """Code points as U+XXXX, at most `most` of them (then how many more)."""
    points = list(points)
    shown = " ".join(f"U+{point:04X}" for point in points[:most])
    return shown + (f" … ({len(points) - most} more)" if len(points) > most else "")
