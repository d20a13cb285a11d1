# ruff: noqa: RUF001  (the check set is made of characters that look like others, on purpose)
"""The built-in check set: texts a fast encoder must encode exactly as the reference library before it is used.

Chosen to reach the places where two implementations of one tokenizer part ways: many scripts,
normalization (NBSP, ligatures, full-width forms, combining marks), whitespace runs, digits,
emoji sequences, control characters, long words, and the model's own special-token strings in every
position. `texts(special)` adds those strings to the fixed ones.

The fixed texts are a sample; the gate (tokenizer_service.core.libraries.gate) also scans every Unicode
code point (`code_point_blocks`, `edge_texts`) and every special-token string (`token_groups`), batched
into large texts so that the scan costs seconds, with each text that differs bisected down to what
differs. `VERSION` names these texts in the gate's cache: change it whenever they change.
"""

from __future__ import annotations

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


VERSION = 3  # of the texts below and the scan: a cached verdict of another version is not used

LONG_TOKEN_CHARS = 256  # a longer special-token string is checked alone and in one context, never repeated
TOKENS_PER_TEXT = 64  # special-token strings batched into one check text (a long one gets a text of its own)
CODE_POINTS_PER_TEXT = 256  # code points batched into one check text


def texts(special: Iterable[str] = ()) -> list[str]:
    """The fixed texts, then the special-token strings alone, in words, spaced, repeated and side by side
    (`token_groups`: every one of them, batched)."""
    out = list(FIXED)
    tokens = [token for token in special if token]
    out += tokens
    out += [token_text(group) for group in token_groups(tokens)]
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
    )


def token_text(tokens: Sequence[str]) -> str:
    """Special-token strings each in its contexts, then side by side, then two spaces apart."""
    if len(tokens) == 1:
        return token_contexts(tokens[0])
    return "".join(token_contexts(token) for token in tokens) + "".join(tokens) + " " + "  ".join(tokens)


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
    """Each code point between a space and a letter, between letters and three times in a row, one line each.

    Each of these neighbourhoods (what comes before and after the code point) matters: a shorter line that
    kept the neighbours but not these pairs of them (` ccca c`) missed U+180E in cl100k_base, which fastokens
    0.3.5 takes for whitespace only between a space and a letter."""
    return "".join(f" {c}a{c}b{c}{c}{c}\n" for c in map(chr, points))


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
