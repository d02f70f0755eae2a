// What the page may fetch: the Content-Security-Policy's connect-src, set before any module
// runs. index.html's <meta> keeps scripts, styles and images to this origin; this script adds
// the policy for fetch: this origin only, unless the address names a model on another origin
// (?model=https://elsewhere/folder) AND opts in to that origin (&allow-origin=https://elsewhere).
// Even then app.js loads nothing before the reader confirms it on the page. A browser enforces
// every policy of a page at once, so no later script can widen this one.
(() => {
  const params = new URLSearchParams(location.search);
  let extra = "";
  try {
    const model = new URL(params.get("model") ?? "model", location.href);
    const allow = params.get("allow-origin");
    if (allow && model.origin !== location.origin && ["http:", "https:"].includes(model.protocol) &&
        new URL(allow).origin === model.origin) {
      extra = " " + model.origin;                // an origin: scheme, host and port, nothing else
    }
  } catch (e) {
    extra = "";                                   // an address that does not parse allows nothing more
  }
  const meta = document.createElement("meta");
  meta.httpEquiv = "Content-Security-Policy";
  meta.content = `connect-src 'self'${extra}`;
  document.head.append(meta);
})();
