# ruff: noqa: RUF001  (the check set is made of characters that look like others, on purpose)
"""The built-in check set: texts a fast encoder must encode exactly as the reference library before it is used.

Chosen to reach the places where two implementations of one tokenizer part ways: many scripts,
normalization (NBSP, ligatures, full-width forms, combining marks), whitespace runs, digits,
emoji sequences, control characters, long words, and the model's own special-token strings in every
position. `texts(special)` adds those strings to the fixed ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

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


MOST_TOKENS = 64  # of a model's added tokens, checked: the first and last halves (a model may add 100,000)


def texts(special: Iterable[str] = ()) -> list[str]:
    """The fixed texts, then each special-token string alone, inside words, spaced, repeated, and all together."""
    out = list(FIXED)
    tokens = [token for token in special if token]
    if len(tokens) > MOST_TOKENS:
        tokens = tokens[: MOST_TOKENS // 2] + tokens[-MOST_TOKENS // 2 :]
    for token in tokens:
        out += [token, f"a{token}b", f" {token} ", token * 3, f"Hello{token}\n{token}world", f"{token}日本語 {token}👍"]
        # whitespace around it, where lstrip/rstrip tokens and whitespace-only added tokens meet
        out += [f"  {token}  ", f"\n\t {token} \t\n", f"x  {token}", f"{token}  x", f"x {token} {token} x"]
    if tokens:
        out.append(" ".join(tokens) + "".join(tokens))
        out += [f"{first}{second}" for first, second in itertools.pairwise(tokens)]  # adjacent pairs
        out += [f"{first}  {second}" for first, second in itertools.pairwise(tokens)]
    return out
