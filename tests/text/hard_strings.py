"""Text that tokenizers split differently: whitespace runs, digits, CJK, emoji, accents, code,
contractions, punctuation runs and mixed scripts."""

HARD = [
    # whitespace runs
    "Hello world", "  two  spaces ", "\t\ttabs\tand  \t mixed", "\n\n\n", " \n ", "line one\nline two\r\nthree\n",
    "", "x", "   ", "trailing   ", "a\u00a0b\u3000c",
    # digits
    "1234567", "3.14", " 42", "a1b22c333", "1,000,000 and 12345678901", "v1.2.3-rc4", "x  7\n\n 8",
    # CJK
    "日本語のテキスト、東京。", "中文，测试！好的", "한국어 텍스트입니다",
    # emoji, ZWJ sequences and modifiers
    "🦊🐶 ✨!", "ends in emoji 🦊  \n✨ ", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "👍🏽 ok",
    # accents, precomposed and combining
    "café naïve Ångström", "cafe\u0301 nai\u0308ve A\u030angstro\u0308m", "ÉCOLE Ærøskøbing ß",
    # code with indentation
    "def f(x):\n    if x > 0:\n        return x ** 2  # square\n    return -x\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    # contractions
    "don't", "I'LL", "We've they're it's 'Re", "o'clock rock'n'roll",
    # punctuation runs
    "!!!???...---===", "a...b!?c", "(parens) [brackets] {braces} <angle>", "slash/path/to/file.txt",
    "email@example.com http://x.y/z?q=1&r=2",
    # mixed scripts and symbols
    "Mixed: English, русский, ελληνικά, العربية, हिन्दी", "ＡＢＣ full-width ｘｙｚ", "µ ℃ ½ ⅔ ² Ⅻ",
    "the xylophone plays",
]
