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

  // Why a refresh failed: the error page's own message (Redis unavailable, say), else the status.
  function failure(response) {
    return response.text().then(function (html) {
      var told = new DOMParser().parseFromString(html, "text/html").getElementById("error");
      var text = told && told.textContent.trim();
      throw new Error(text || "the dashboard answered HTTP " + response.status);
    });
  }

  // How long a refresh waits for the dashboard: longer than its own wait on Redis (10 s), so that
  // its error page, which says why, comes first; a dashboard that hangs says nothing at all.
  var WAIT_MS = 20000;

  function refresh(box, every) {
    var busy = false;
    var since = new Date();
    var notice = document.getElementById("stale");
    setInterval(function () {
      if (busy || document.hidden) return; // one request at a time, none for a hidden tab
      busy = true;
      var waiting = new AbortController();
      var timer = setTimeout(function () { waiting.abort(); }, WAIT_MS);
      fetch(box.getAttribute("data-src"), { credentials: "same-origin", cache: "no-store", signal: waiting.signal })
        .then(function (response) {
          return response.ok ? response.text() : failure(response);
        })
        .catch(function (error) {
          if (waiting.signal.aborted) throw new Error("the dashboard did not answer within " + WAIT_MS / 1000 + " s");
          if (error instanceof TypeError) throw new Error("the dashboard did not answer");
          throw error;
        })
        .then(function (html) {
          box.innerHTML = html; // the server's own template, every message field escaped there
          localTimes(box);
          since = new Date();
          box.setAttribute("data-refreshed", String(since.getTime()));
          document.body.classList.remove("stale");
          if (notice) notice.hidden = true;
        })
        .catch(function (error) {
          // The figures stay, dimmed, and say how old they are and why.
          document.body.classList.add("stale");
          if (!notice) return;
          notice.textContent = "Not refreshed since " + since.toLocaleTimeString() + ": " + error.message +
            ". The figures below are from then.";
          notice.hidden = false;
        })
        .finally(function () {
          clearTimeout(timer);
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
