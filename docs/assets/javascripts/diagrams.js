// Draws the ```mermaid fences (div.fsm-diagram) with the vendored mermaid.min.js: no CDN,
// so the site renders offline, and the SVG lands in the page where a test can find it.
(function () {
  function draw() {
    var nodes = document.querySelectorAll("div.fsm-diagram:not([data-processed])");
    if (nodes.length === 0) return;
    mermaid.initialize({ startOnLoad: false, securityLevel: "strict", theme: "neutral" });
    mermaid.run({ nodes: nodes });
  }
  if (typeof document$ !== "undefined") {
    document$.subscribe(draw); // Material re-emits on every page, instant navigation included
  } else {
    document.addEventListener("DOMContentLoaded", draw);
  }
})();
