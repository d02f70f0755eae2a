// Code keeps its indentation when a line wraps (a phone): each line of a code block becomes
// a block of its own whose continuation rows hang under the line's code, four columns in
// (attn.css, .attn-line), instead of restarting at column 0.
//
// The lessons' output tables keep their columns on a narrow page: where a block's widest
// table line (a line with columns: two spaces or more between words) is wider than the page,
// the block's font shrinks until it fits, down to 60 %. Prose lines longer than the page wrap
// (attn.css), as does a table too wide even at 60 %.
(function () {
  function charWidth(pre) {
    var probe = document.createElement("span");
    probe.textContent = "0000000000";
    probe.style.visibility = "hidden";
    pre.appendChild(probe);
    var w = probe.getBoundingClientRect().width / 10;
    pre.removeChild(probe);
    return w;
  }
  function fit() {
    document.querySelectorAll("div.cell_output pre").forEach(function (pre) {
      pre.style.fontSize = "";
      var widest = 0;
      pre.innerText.split("\n").forEach(function (line) {
        if (/\S {2,}\S/.test(line)) widest = Math.max(widest, line.length);
      });
      if (!widest) return;
      var style = getComputedStyle(pre);
      var room = pre.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
      var need = widest * charWidth(pre);
      if (need > room) {
        var base = parseFloat(style.fontSize);
        var size = Math.floor(base * room / need * 10) / 10;
        if (size >= base * 0.6) pre.style.fontSize = size + "px";
      }
    });
  }
  function splitLines(pre) {
    var lines = [[]];
    Array.from(pre.childNodes).forEach(function (node) {
      var parts = node.textContent.split("\n");
      parts.forEach(function (part, i) {
        if (i > 0) lines.push([]);
        if (!part) return;
        if (parts.length === 1) { lines[lines.length - 1].push(node); return; }
        var copy = node.nodeType === Node.TEXT_NODE ? document.createTextNode(part) : node.cloneNode(false);
        if (copy.nodeType !== Node.TEXT_NODE) copy.textContent = part;
        lines[lines.length - 1].push(copy);
      });
    });
    if (lines.length > 1 && !lines[lines.length - 1].length) lines.pop();
    return lines;
  }
  function hangIndent() {
    document.querySelectorAll("div.highlight pre").forEach(function (pre) {
      if (pre.closest(".cell_output") || pre.querySelector(".attn-line")) return;
      var lines = splitLines(pre);
      pre.textContent = "";
      lines.forEach(function (nodes) {
        var line = document.createElement("span");
        line.className = "attn-line";
        nodes.forEach(function (n) { line.appendChild(n); });
        line.style.setProperty("--attn-indent", line.textContent.match(/^ */)[0].length);
        pre.appendChild(line);
      });
    });
  }
  // Inline maths wider than the column (a phone) scrolls in its own box; the theme's box
  // hides what overflows. Only those boxes scroll: a scrolling box would move the baseline of
  // every other inline formula.
  function scrollWideMath() {
    document.querySelectorAll("span.math").forEach(function (span) {
      span.classList.remove("attn-wide");
      var shown = span.querySelector("mjx-container > mjx-math");    // not the wider hidden MathML
      if (shown && shown.getBoundingClientRect().width > span.clientWidth + 1) span.classList.add("attn-wide");
    });
  }
  // On a phone, a figure shrunk to the column shows its text smaller than the body's: such a
  // figure is shown at the width where its smallest text (data-text-px, in pixels of the
  // image, book/conf.py) is the body text's size, and scrolls sideways in its own box. A wide
  // screen shows every figure whole (tests/test_book.py holds its text to MIN_TEXT_PX there).
  var PHONE = window.matchMedia("(max-width: 600px)");
  function readableFigures() {
    var body = parseFloat(getComputedStyle(document.querySelector("article p") || document.body).fontSize);
    document.querySelectorAll("a.attn-figure > img[data-text-px]").forEach(function (img) {
      var px = parseFloat(img.dataset.textPx);
      img.style.width = img.style.maxWidth = "";
      img.parentNode.classList.remove("attn-wide");
      if (!PHONE.matches || !(px > 0) || !img.naturalWidth) return;
      if (px * img.getBoundingClientRect().width / img.naturalWidth >= body) return;
      img.style.maxWidth = "none";
      img.style.width = Math.ceil(img.naturalWidth * body / px) + "px";
      img.parentNode.classList.add("attn-wide");
    });
  }
  function afterMath() {
    var ready = window.MathJax && MathJax.startup && MathJax.startup.promise;
    (ready || Promise.resolve()).then(scrollWideMath);
  }
  function start() { hangIndent(); fit(); }
  window.addEventListener("load", afterMath);
  window.addEventListener("load", readableFigures);
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
  var timer;
  window.addEventListener("resize", function () {
    clearTimeout(timer);
    timer = setTimeout(function () { fit(); scrollWideMath(); readableFigures(); }, 100);
  });
})();
