// Confirm each action before its POST; refresh <main> every few seconds
// from ?fragment=1 without a full reload (paused while a form has focus).
"use strict";
document.addEventListener("submit", function (event) {
  var message = event.target.getAttribute("data-confirm");
  if (message && !window.confirm(message)) event.preventDefault();
});
(function () {
  var main = document.getElementById("main");
  if (!main) return;
  var seconds = Number(main.getAttribute("data-refresh")) || 5;
  function refresh() {
    var active = document.activeElement;
    if (active && main.contains(active) && active.tagName === "INPUT") return;
    var url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    fetch(url, {credentials: "same-origin", headers: {"x-requested-with": "fetch"}})
      .then(function (answer) {
        if (answer.status === 401 || answer.redirected) { window.location.reload(); return null; }
        return answer.ok ? answer.text() : null;
      })
      .then(function (html) {
        if (html === null) return;
        var open = Array.prototype.map.call(main.querySelectorAll("details[open]"), function (d) { return d.textContent.slice(0, 80); });
        main.innerHTML = html;
        main.querySelectorAll("details").forEach(function (d) { if (open.indexOf(d.textContent.slice(0, 80)) >= 0) d.open = true; });
        main.setAttribute("data-refreshed", String(Date.now()));
      })
      .catch(function () {});
  }
  window.setInterval(refresh, seconds * 1000);
})();
