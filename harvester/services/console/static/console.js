// The reaper console's only script: times in the viewer's zone (UTC stays in the title), and live
// parts of a page fetched again every few seconds. Everything it changes is also readable without it.
(function () {
  "use strict";
  var pad = function (n) { return (n < 10 ? "0" : "") + n; };
  function zone(d) {
    var m = -d.getTimezoneOffset(), sign = m < 0 ? "-" : "+";
    m = Math.abs(m);
    return "UTC" + sign + pad(Math.floor(m / 60)) + ":" + pad(m % 60);
  }
  function localTimes(root) {
    var times = root.querySelectorAll("time[datetime]");
    for (var i = 0; i < times.length; i++) {
      var d = new Date(times[i].getAttribute("datetime"));
      if (isNaN(d)) continue;
      times[i].textContent = d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
        pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) + " " + zone(d);
    }
  }
  function live(el, every) {
    var url = el.getAttribute("data-live");
    function tick() {
      if (document.hidden) { setTimeout(tick, every); return; }
      fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (r) {
          if (r.redirected || r.status === 401) { location.reload(); return null; }
          return r.ok ? r.text() : null;
        })
        .then(function (html) {
          if (html !== null && html !== undefined) {
            el.innerHTML = html;
            localTimes(el);
            el.setAttribute("data-updated", String(Date.now()));
          }
        })
        .catch(function () {})
        .then(function () { setTimeout(tick, every); });
    }
    setTimeout(tick, every);
  }
  document.addEventListener("DOMContentLoaded", function () {
    localTimes(document);
    var every = parseInt(document.body.getAttribute("data-refresh") || "5000", 10);
    var parts = document.querySelectorAll("[data-live]");
    for (var i = 0; i < parts.length; i++) live(parts[i], every);
  });
})();
