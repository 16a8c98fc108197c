// The live part of a page: the element with data-live="URL" takes the HTML of each server-sent
// event of URL (the server sends one only when the reading changed, at most once a second). The
// stream is closed while the tab is hidden and opened again when it shows; EventSource reconnects
// by itself when the server ends a stream (it does every few minutes).
(function () {
  "use strict";
  var el = document.querySelector("[data-live]");
  if (!el || !window.EventSource) return;
  var source = null;
  function open() {
    if (source || document.hidden) return;
    source = new EventSource(el.getAttribute("data-live"));
    source.addEventListener("live", function (e) {
      el.innerHTML = e.data;
      el.setAttribute("data-updates", String(Number(el.getAttribute("data-updates") || "0") + 1));
    });
    el.setAttribute("data-stream", "open");
  }
  function close() {
    if (source) source.close();
    source = null;
    el.setAttribute("data-stream", "closed");
  }
  document.addEventListener("visibilitychange", function () { if (document.hidden) close(); else open(); });
  window.addEventListener("pagehide", close);
  open();
})();
