// Text <-> tokens without loss: the JavaScript twin of attn/text.py.
//
//   tokenize("It's 3.5 km, „quite“ far.")
//     -> ["It's", "3", "##.", "##5", "km", "##,", "„", "##quite", "##“", "far", "##."]
//   detokenize(tokenize(s)) === normalize(s)      for every string s
//
// A token is a *word* (a run of letters, marks, digits and "_", which may hold an
// apostrophe, hyphen or zero-width (non-)joiner between two word characters) or one other
// visible character. A token with no space before it carries the prefix "##".
// normalize() drops invisible format characters (not the joiners), applies NFC, and turns
// every run of whitespace, control characters and zero-width spaces into one space.
//
// Strings are walked by code point (Array.from), as Python indexes them. The character
// classes are Unicode general categories, as Python's unicodedata gives them; the two agree
// on every character both Unicode versions assign (tests/test_web.py checks every code point).

export const GLUE = "##";

const JOINERS = new Set(["'", "\u2019", "-", "\u2010", "\u200c", "\u200d"]);  // ' ’ - ‐ ZWNJ ZWJ
const ZWSP = "\u200b";
const WORD = /^[\p{L}\p{M}\p{N}_]$/u;          // category L*, M*, N*, or "_"
const SEPARATOR = /^[\p{Z}\p{Cc}]$/u;           // category Z* or Cc (Python's isspace() adds nothing to these)
const FORMAT = /^\p{Cf}$/u;
export const BYTE_TOKEN = /^<0x([0-9A-F]{2})>$/;

// "w" word character, "s" separator, "x" dropped, "p" a token on its own (attn.text._char_kind).
export function charKind(ch) {
  if (WORD.test(ch)) return "w";
  if (SEPARATOR.test(ch) || ch === ZWSP) return "s";
  if (FORMAT.test(ch) && !JOINERS.has(ch)) return "x";
  return "p";
}

// The text as tokenize() sees it and detokenize() gives it back.
export function normalize(text) {
  // drop invisible format characters first: "a<soft hyphen><combining acute>" must become "á"
  const kept = Array.from(text).filter((ch) => charKind(ch) !== "x").join("").normalize("NFC");
  const spaced = Array.from(kept, (ch) => (charKind(ch) === "s" ? " " : ch)).join("");
  return spaced.split(" ").filter((part) => part.length > 0).join(" ");
}

// [[token text, glued to the previous token?], ...] of normalised text (attn.text._spans_unicode).
function spans(text) {
  const chars = Array.from(normalize(text));
  const kinds = chars.map(charKind);
  const tokens = [];
  let glued = false;       // no space between the previous token and the current position
  let start = -1;          // where the current word started (-1: not in a word)
  for (let i = 0; i < chars.length; i++) {
    const ch = chars[i], kind = kinds[i];
    if (kind === "w" || (JOINERS.has(ch) && start >= 0 && i + 1 < chars.length && kinds[i + 1] === "w")) {
      if (start < 0) start = i;       // "don't": the apostrophe sits between two word characters
      continue;
    }
    if (start >= 0) {
      tokens.push([chars.slice(start, i).join(""), glued]);
      start = -1;
      glued = true;
    }
    if (kind === "s") {                 // normalize() left exactly one space here
      glued = false;
    } else {
      tokens.push([ch, glued]);
      glued = true;
    }
  }
  if (start >= 0) tokens.push([chars.slice(start).join(""), glued]);
  if (tokens.length > 0) tokens[0][1] = false;
  return tokens;
}

// Split text into words and single marks; a token with no space before it gets "##".
export function tokenize(text) {
  return spans(text).map(([tok, glued]) => (glued ? GLUE + tok : tok));
}

// "##," -> [",", true]; "word" -> ["word", false]
export function splitGlue(token) {
  return token.startsWith(GLUE) ? [token.slice(GLUE.length), true] : [token, false];
}

const utf8 = new TextEncoder();

// Join tokens back into text: a space before each token, none before a "##" one. Works on
// UTF-8 bytes, so that byte tokens <0xNN> join into the character they spell; bytes that are
// not valid UTF-8 become U+FFFD.
export function detokenize(tokens) {
  const bytes = [];
  for (const tok of tokens) {
    const [body, glued] = splitGlue(String(tok));
    if (bytes.length > 0 && !glued) bytes.push(0x20);
    const m = BYTE_TOKEN.exec(body);
    if (m) bytes.push(parseInt(m[1], 16));
    else for (const b of utf8.encode(body)) bytes.push(b);
  }
  return new TextDecoder("utf-8").decode(new Uint8Array(bytes));
}
