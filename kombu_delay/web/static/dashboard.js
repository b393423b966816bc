// kombu-delay dashboard: local due times, and the overview's refresh without reloading the page.
(function () {
  "use strict";

  function localTimes(root) {
    root.querySelectorAll("time[data-ms]").forEach(function (el) {
      var at = new Date(Number(el.getAttribute("data-ms")));
      el.textContent = at.toLocaleString();
      el.setAttribute("datetime", at.toISOString());
      el.title = at.toISOString();
    });
  }

  function refresh(box, every) {
    var busy = false;
    setInterval(function () {
      if (busy || document.hidden) return; // one request at a time, none for a hidden tab
      busy = true;
      fetch(box.getAttribute("data-src"), { credentials: "same-origin", cache: "no-store" })
        .then(function (response) {
          if (!response.ok) throw new Error("HTTP " + response.status);
          return response.text();
        })
        .then(function (html) {
          box.innerHTML = html; // the server's own template, every message field escaped there
          localTimes(box);
          box.setAttribute("data-refreshed", String(Date.now()));
          document.body.classList.remove("stale");
        })
        .catch(function () {
          document.body.classList.add("stale");
        })
        .finally(function () {
          busy = false;
        });
    }, every);
  }

  document.addEventListener("DOMContentLoaded", function () {
    localTimes(document);
    var box = document.getElementById("overview");
    var every = Number(document.body.getAttribute("data-refresh-ms"));
    // A timer holds at most 2^31 - 1 ms; a longer delay fires at once, and then without pause.
    if (box && every > 0) refresh(box, Math.min(every, 2147483647));
  });
})();
