// The fleet map's live updates: the server sends the cells that changed (Server-Sent Events,
// `/console/fleet/events`) and this patches them in place: colour class, code, mark, label.
(function () {
  "use strict";
  function patch(c) {
    var el = document.getElementById("n-" + c.id);
    if (!el) { return; }
    if (el.dataset.state === c.state && el.dataset.health === c.health &&
        el.classList.contains("cordoned") === c.cordoned) { return; }
    el.className = "cell state-" + c.state + " health-" + c.health + (c.cordoned ? " cordoned" : "") + " changed";
    el.dataset.state = c.state;
    el.dataset.health = c.health;
    el.setAttribute("aria-label", c.label);
    el.querySelector("b").textContent = c.code;
    el.querySelector("i").textContent = c.mark;
  }
  function start() {
    var fleet = document.getElementById("fleet");
    var live = document.getElementById("live");
    if (!fleet || !window.EventSource) { return; }
    var source = new EventSource(fleet.dataset.stream);
    source.onopen = function () { live.textContent = "live"; };
    source.onerror = function () { live.textContent = "live updates reconnecting…"; };
    source.addEventListener("nodes", function (event) {
      JSON.parse(event.data).forEach(patch);
      live.textContent = "live, updated " + new Date().toLocaleTimeString();
    });
  }
  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", start); } else { start(); }
})();
