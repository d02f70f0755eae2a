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
      pre.textContent.split("\n").forEach(function (line) {
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
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", fit);
  else fit();
  var timer;
  window.addEventListener("resize", function () { clearTimeout(timer); timer = setTimeout(fit, 100); });
})();
