// The Ballast dashboard's script: keeps the page live without reloading it. A service
// page follows its watch feed and, on each event, fetches the server-rendered
// fragments and charts again; the overview fetches its table every few seconds.
// Tables sort by a click on a header.
(function () {
  "use strict";
  var ui = (window.ballastUi = { loadedAt: Date.now(), refreshes: 0, events: 0 });
  var status = document.getElementById("live-status");
  var sorted = {}; // table id -> {col, dir}
  var last = Date.now();

  function setStatus(cls, text) {
    status.className = "status " + cls;
    status.textContent = text;
  }

  function key(row, col, numeric) {
    var cell = row.cells[col];
    if (!cell) return numeric ? 0 : "";
    return numeric ? parseFloat(cell.getAttribute("data-v") || "0") : cell.textContent.trim().toLowerCase();
  }

  function sortTable(table) {
    var s = sorted[table.id];
    if (!s || !table.tBodies[0]) return;
    var th = table.tHead.rows[0].cells[s.col];
    var numeric = th.getAttribute("data-sort") === "num";
    var rows = Array.prototype.slice.call(table.tBodies[0].rows);
    rows.sort(function (a, b) {
      var x = key(a, s.col, numeric), y = key(b, s.col, numeric);
      return (x < y ? -1 : x > y ? 1 : 0) * s.dir;
    });
    rows.forEach(function (r) { table.tBodies[0].appendChild(r); });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (c, i) {
      if (i === s.col) c.setAttribute("aria-sort", s.dir > 0 ? "ascending" : "descending");
      else c.removeAttribute("aria-sort");
    });
  }

  document.addEventListener("click", function (ev) {
    var th = ev.target.closest("th[data-sort]");
    if (!th) return;
    var table = th.closest("table");
    var s = sorted[table.id];
    sorted[table.id] = { col: th.cellIndex, dir: s && s.col === th.cellIndex ? -s.dir : 1 };
    sortTable(table);
  });

  // One refresh at a time; a call during one gets the next, which starts after it.
  var running = null, queued = null;
  function refresh() {
    if (running) {
      if (!queued) queued = running.then(function () { queued = null; return refresh(); });
      return queued;
    }
    last = Date.now();
    var parts = document.querySelectorAll("[data-live]");
    var jobs = Array.prototype.map.call(parts, function (el) {
      return fetch(el.getAttribute("data-live"), { cache: "no-store" }).then(function (r) {
        if (!r.ok) throw new Error(r.status === 404 ? "gone" : "HTTP " + r.status);
        return r.text();
      }).then(function (html) {
        el.innerHTML = html;
        Array.prototype.forEach.call(el.querySelectorAll("table.sortable"), sortTable);
      });
    });
    Array.prototype.forEach.call(document.querySelectorAll("img[data-chart]"), function (img) {
      img.src = img.getAttribute("data-chart") + "?t=" + last;
    });
    running = Promise.all(jobs).then(function () {
      ui.refreshes++;
      setStatus("live", "live · updated " + new Date().toLocaleTimeString());
    }, function (e) {
      setStatus("down", e.message === "gone" ? "service gone" : "cannot reach the aggregator");
    }).then(function () { running = null; });
    return running;
  }
  ui.refresh = refresh;

  // At most one refresh a second, however fast the weights change.
  var timer = null;
  function soon() {
    if (timer) return;
    timer = setTimeout(function () { timer = null; refresh(); }, Math.max(0, last + 1000 - Date.now()));
  }

  var watch = document.body.getAttribute("data-watch");
  if (watch) {
    var feed = new EventSource(watch);
    feed.addEventListener("weights", function () { ui.events++; soon(); });
    feed.onopen = function () { setStatus("live", "live"); };
    feed.onerror = function () { setStatus("down", "reconnecting…"); };
  }
  // Load moves every cycle even when the weights hold still: redraw now and then.
  var poll = document.querySelector("[data-poll]");
  var every = poll ? parseInt(poll.getAttribute("data-poll"), 10) : 5000;
  if (!watch) setStatus("live", "live");
  setInterval(function () {
    if (!document.hidden && Date.now() - last >= every) refresh();
  }, 500);
})();
