// The Ballast dashboard's script: keeps the page live without reloading it. A service
// page follows its watch feed and, on each event, fetches the server-rendered
// fragments and charts again; the overview fetches its table every few seconds.
// Tables sort by a click on a header.
//
// Behind bearer tokens, the sign-in form keeps the token in a variable of this script,
// never in storage or a cookie (a reload forgets it), and sends it as
// `Authorization: Bearer` with every request the page makes: fragments, charts (as
// blobs), the watch feed (read with fetch, since EventSource sends no header), and the
// pages themselves, which are then swapped in place rather than navigated to, so that
// the token lives as long as the tab's page. Without a token (an open API, or a client
// certificate the browser presents) the page works as it always did.
(function () {
  "use strict";
  var ui = (window.ballastUi = { loadedAt: Date.now(), refreshes: 0, events: 0, pages: 0 });
  var token = null; // the bearer token, in memory only
  var status = null;
  var sorted = {}; // table id -> {col, dir}
  var last = Date.now();
  var every = 5000;
  var stopFeed = null; // ends the current page's watch
  var signIn = false; // the page is the sign-in form

  function setStatus(cls, text) {
    if (!status) return;
    status.className = "status " + cls;
    status.textContent = text;
  }

  // Fetch options carrying the token, if there is one.
  function authed(opts) {
    opts = opts || {};
    if (token) {
      var headers = {};
      for (var k in opts.headers || {}) headers[k] = opts.headers[k];
      headers.Authorization = "Bearer " + token;
      opts.headers = headers;
    }
    return opts;
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

  // A chart: by its URL, or with a token fetched and shown as a blob.
  function loadChart(img, url) {
    if (!token) {
      img.src = url;
      return Promise.resolve();
    }
    return fetch(url, authed({ cache: "no-store" })).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.blob();
    }).then(function (blob) {
      var old = img.getAttribute("data-blob");
      var src = URL.createObjectURL(blob);
      img.setAttribute("data-blob", src);
      img.src = src;
      if (old) URL.revokeObjectURL(old);
    });
  }

  // One refresh at a time; a call during one gets the next, which starts after it.
  var running = null, queued = null;
  function refresh() {
    if (signIn) return Promise.resolve();
    if (running) {
      if (!queued) queued = running.then(function () { queued = null; return refresh(); });
      return queued;
    }
    last = Date.now();
    var parts = document.querySelectorAll("[data-live]");
    var jobs = Array.prototype.map.call(parts, function (el) {
      return fetch(el.getAttribute("data-live"), authed({ cache: "no-store" })).then(function (r) {
        if (!r.ok) throw new Error(r.status === 404 ? "gone" : r.status === 401 ? "signed out" : "HTTP " + r.status);
        return r.text();
      }).then(function (html) {
        el.innerHTML = html;
        Array.prototype.forEach.call(el.querySelectorAll("table.sortable"), sortTable);
      });
    });
    Array.prototype.forEach.call(document.querySelectorAll("img[data-chart]"), function (img) {
      jobs.push(loadChart(img, img.getAttribute("data-chart") + "?t=" + last));
    });
    running = Promise.all(jobs).then(function () {
      ui.refreshes++;
      setStatus("live", "live · updated " + new Date().toLocaleTimeString());
    }, function (e) {
      setStatus("down", e.message === "gone" ? "service gone" :
        e.message === "signed out" ? "the token was refused: reload to sign in" : "cannot reach the aggregator");
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

  // Follows the watch feed at `url`, calling soon() on each weight set; returns what
  // ends it.
  function follow(url) {
    if (!token) {
      var feed = new EventSource(url);
      feed.addEventListener("weights", function () { ui.events++; soon(); });
      feed.onopen = function () { setStatus("live", "live"); };
      feed.onerror = function () { setStatus("down", "reconnecting…"); };
      return function () { feed.close(); };
    }
    var stopped = false, abort = new AbortController();
    function run() {
      fetch(url, authed({ cache: "no-store", signal: abort.signal })).then(function (r) {
        if (!r.ok || !r.body) throw new Error("HTTP " + r.status);
        setStatus("live", "live");
        var reader = r.body.getReader(), text = new TextDecoder(), buf = "";
        function pump() {
          return reader.read().then(function (chunk) {
            if (chunk.done) throw new Error("the stream ended");
            buf += text.decode(chunk.value, { stream: true }).replace(/\r\n?/g, "\n");
            var end;
            while ((end = buf.indexOf("\n\n")) >= 0) {
              var event = buf.slice(0, end);
              buf = buf.slice(end + 2);
              if (/^event: ?weights$/m.test(event)) { ui.events++; soon(); }
            }
            return pump();
          });
        }
        return pump();
      }).catch(function () {
        if (stopped) return;
        setStatus("down", "reconnecting…");
        setTimeout(function () { if (!stopped) run(); }, 2000);
      });
    }
    run();
    return function () { stopped = true; abort.abort(); };
  }

  // Sets up the page in the document: its status, its watch feed, its refreshes.
  function start() {
    status = document.getElementById("live-status");
    if (stopFeed) { stopFeed(); stopFeed = null; }
    signIn = !!document.getElementById("login");
    if (signIn) {
      setStatus("down", "sign in");
      var field = document.getElementById("token");
      if (field) field.focus();
      return;
    }
    var watch = document.body.getAttribute("data-watch");
    if (watch) stopFeed = follow(watch);
    var poll = document.querySelector("[data-poll]");
    every = poll ? parseInt(poll.getAttribute("data-poll"), 10) : 5000;
    if (!watch) setStatus("live", "live");
    // A page swapped in has its charts still to load.
    if (token) refresh();
  }

  // Shows the page at `url`, fetched with the token, in place of this one.
  function open(url, push) {
    return fetch(url, authed({ cache: "no-store" })).then(function (r) {
      if (r.status === 401) throw new Error("The token was refused.");
      if (r.status === 403) throw new Error("The token's role may not read the dashboard.");
      return r.text();
    }).then(function (html) {
      var doc = new DOMParser().parseFromString(html, "text/html");
      // Charts load with the token, not by their URL.
      Array.prototype.forEach.call(doc.querySelectorAll("img[data-chart]"), function (img) {
        img.removeAttribute("src");
      });
      document.title = doc.title;
      document.documentElement.replaceChild(document.adoptNode(doc.body), document.body);
      if (push) history.pushState(null, "", url);
      ui.pages++;
      start();
    });
  }

  document.addEventListener("submit", function (ev) {
    if (ev.target.id !== "login") return;
    ev.preventDefault();
    var error = document.getElementById("login-error");
    token = ev.target.elements.token.value.trim() || null;
    if (!token) return;
    open(location.pathname + location.search, false).catch(function (e) {
      token = null;
      if (error) error.textContent = e.message;
    });
  });

  // With a token, links within the dashboard swap pages in place.
  document.addEventListener("click", function (ev) {
    if (!token || ev.defaultPrevented || ev.button !== 0 || ev.metaKey || ev.ctrlKey || ev.shiftKey) return;
    var a = ev.target.closest("a[href]");
    if (!a) return;
    var href = a.getAttribute("href");
    if (href !== "/ui" && href.indexOf("/ui/") !== 0) return;
    ev.preventDefault();
    open(href, true).catch(function () { setStatus("down", "the token was refused: reload to sign in"); });
  });
  window.addEventListener("popstate", function () {
    if (token) open(location.pathname + location.search, false).catch(function () {});
  });

  start();
  // Load moves every cycle even when the weights hold still: redraw now and then.
  setInterval(function () {
    if (!document.hidden && Date.now() - last >= every) refresh();
  }, 500);
})();
