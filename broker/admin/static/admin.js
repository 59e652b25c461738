// Small progressive enhancements; every page works without this script.
(function () {
  // Warn before the session expires, and send the admin to the login page when it has.
  var el = document.querySelector("[data-expires]");
  if (el) {
    var expires = parseInt(el.getAttribute("data-expires"), 10) * 1000;
    var tick = function () {
      var left = expires - Date.now();
      if (left <= 0) { window.location = "/admin/login?why=expired"; return; }
      var m = Math.floor(left / 60000);
      el.textContent = m >= 1 ? "session: " + m + " min left" : "session ends in under a minute";
      el.style.color = m < 3 ? "#f5a524" : "";
    };
    tick(); setInterval(tick, 15000);
  }
  // Confirm destructive actions.
  document.addEventListener("submit", function (ev) {
    var btn = ev.submitter;
    if (btn && btn.value === "ban" && !window.confirm("Ban this provider? It will get no new jobs and cannot reconnect.")) ev.preventDefault();
  });
})();
