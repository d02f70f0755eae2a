// Tables in the lessons' output keep their columns: where an output block is wider than the
// page, its font shrinks until it fits (down to 60 %); only past that does it wrap.
(function () {
  function fit() {
    document.querySelectorAll("div.cell_output pre").forEach(function (pre) {
      pre.classList.add("attn-table");
      pre.style.fontSize = "";
      var base = parseFloat(getComputedStyle(pre).fontSize);
      var need = pre.scrollWidth, have = pre.clientWidth;
      if (need > have + 1) {
        var size = Math.floor(base * have / need * 10) / 10;
        if (size >= base * 0.6) {
          pre.style.fontSize = size + "px";
          if (pre.scrollWidth > pre.clientWidth + 1) pre.classList.remove("attn-table");
        } else {
          pre.classList.remove("attn-table");
        }
      }
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", fit);
  else fit();
  var timer;
  window.addEventListener("resize", function () { clearTimeout(timer); timer = setTimeout(fit, 100); });
})();
