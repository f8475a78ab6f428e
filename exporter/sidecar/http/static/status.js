// The status page's refresh: fetches api/v1/status every few seconds and rebuilds each section
// with the same structure as exporter/sidecar/expose/page.py renders on the server. Values only ever go
// in through textContent and setAttribute, never parsed as markup, so a label value is always text.
"use strict";

(function () {
  const STATES = ["live", "stale", "departed", "expired"];
  const MISSING = "missing";  // a rank (position) its server's world expects and no unexpired stream reports for
  const KINDS = ["radix", "storage", "scheduler"];  // a cell lists its streams in this order, pushed clients last
  const UNEXPECTED = "outside world";  // a rank or dp group its server's expected world does not hold
  const SPARK_WIDTH = 120;
  const SPARK_HEIGHT = 24;
  const SVG = "http://www.w3.org/2000/svg";

  // --- DOM building ---

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined) node.setAttribute(name, String(value));
    }
    for (const child of children || []) {
      node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  function text(tag, value, attrs) {
    const node = el(tag, attrs);
    node.textContent = String(value);
    return node;
  }

  function row(cells, cls) {
    return el("tr", cls ? { class: cls } : {}, cells.map((c) => text("td", c)));
  }

  function table(head, rows, empty, cols) {
    const body = el("tbody", {}, rows);
    if (rows.length === 0) body.appendChild(el("tr", {}, [text("td", empty, { colspan: cols, class: "empty" })]));
    if (!head.some((h) => h)) return el("table", {}, [body]);  // a key-value table: no header row
    return el("table", {}, [el("thead", {}, [el("tr", {}, head.map((h) => text("th", h)))]), body]);
  }

  // --- number formats (page.py has the same ones) ---

  function fmtNumber(v) {
    if (v === null || v === undefined) return "–";
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    if (Math.abs(v) < 1000) return String(Number(v.toPrecision(3)));
    return Math.round(v).toLocaleString("en-US");
  }

  function fmtBytes(v) {
    if (v === null || v === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    for (const unit of units) {
      if (Math.abs(v) < 1024 || unit === "TiB") return unit === "B" ? `${v.toFixed(0)} B` : `${v.toFixed(1)} ${unit}`;
      v /= 1024;
    }
    return "";
  }

  function fmtRate(v) {
    if (v === null || v === undefined) return "idle";
    const units = ["B/s", "kB/s", "MB/s", "GB/s"];
    for (const unit of units) {
      if (Math.abs(v) < 1000 || unit === "GB/s") return unit === "B/s" ? `${v.toFixed(0)} B/s` : `${v.toFixed(2)} ${unit}`;
      v /= 1000;
    }
    return "";
  }

  function fmtSeconds(v) {
    if (v === null || v === undefined) return "never";
    if (v < 10) return `${v.toFixed(1)} s`;
    const whole = Math.trunc(v);
    for (const [size, unit, subSize, subUnit] of [[86400, "d", 3600, "h"], [3600, "h", 60, "m"], [60, "m", 1, "s"]]) {
      if (whole >= size) return `${Math.trunc(whole / size)} ${unit} ${Math.trunc((whole % size) / subSize)} ${subUnit}`;
    }
    return `${whole} s`;
  }

  function fmtTime(t) {
    return new Date(t * 1000).toISOString().slice(11, 19) + " UTC";
  }

  function fmtRatio(v) {
    return `${(v * 100).toFixed(1)}%`;
  }

  // A null breaks the line, and so does a value that is not a finite number (the API sends none,
  // but a path with NaN in it is not drawn at all).
  function sparklinePath(history, points) {
    const values = history.map((p) => p[1]).filter((v) => Number.isFinite(v));
    const top = values.length ? Math.max(...values) || 1 : 1;
    const first = points - history.length;
    const step = SPARK_WIDTH / Math.max(points - 1, 1);
    const parts = [];
    let penDown = false;
    history.forEach(([, value], index) => {
      if (!Number.isFinite(value)) {
        penDown = false;
        return;
      }
      const x = (first + index) * step;
      const y = SPARK_HEIGHT - 1 - (value / top) * (SPARK_HEIGHT - 2);
      parts.push(`${penDown ? "L" : "M"}${x.toFixed(1)} ${y.toFixed(1)}`);
      penDown = true;
    });
    return parts.join(" ");
  }

  // --- sections ---

  function legend() {
    return el("p", { class: "legend" }, STATES.concat([MISSING]).map((s) => text("span", s, { class: `swatch state-${s}` })));
  }

  function plural(n, word) {
    return `${fmtNumber(n)} ${word}${n === 1 ? "" : "s"}`;
  }

  // A world as the page and top name it (v1.world_name).
  function worldName(w) {
    const cp = w.attn_cp_size > 1 ? ` × cp ${w.attn_cp_size}` : "";
    return `dp ${w.dp_size} × pp ${w.pp_size}${cp} × tp ${w.attn_tp_size}`;
  }

  function worldKey(w) {
    return [w.dp_size, w.pp_size, w.attn_cp_size, w.attn_tp_size, w.tp_size].join(",");
  }

  function quoted(labels) {  // name="value", backslash, quote and newline escaped, as /metrics writes them
    return Object.entries(labels).map(([k, v]) =>
      `${k}="${v.replace(/\\/g, "\\\\").replace(/"/g, '\\"').replace(/\n/g, "\\n")}"`);
  }

  function serverName(n, server) {
    return quoted(n.labels.get(server.label_set)).join(" ") || "server";
  }

  function serverWorld(server) {
    if (server.expected !== null) return worldName(server.expected);
    return server.world_conflict ? "world conflict" : "no world reported";
  }

  // What the document writes once and references by id, read back as text (page.py's Names).
  function names(doc) {
    const labels = new Map(doc.label_sets.map((s) => [s.id, s.labels]));
    const groups = new Map(doc.groups.map((g) => [g.id, g]));
    const streams = new Map(doc.streams.map((s) => [s.id, s]));
    return {
      labels, groups, streams,
      group: (g) => [`dp=${g.dp_rank}`].concat(quoted(labels.get(g.label_set))).join(" "),
    };
  }

  // `tp=.. pp=.. dp=.. [cp=..] name="value" ...`: a stream's axes as labelled, then every static label in name order.
  function streamIdentity(n, r) {
    const all = Object.assign({}, n.labels.get(n.groups.get(r.group).label_set), r.own_labels);
    const sorted = Object.fromEntries(Object.keys(all).sort().map((k) => [k, all[k]]));
    const cp = r.attn_cp_rank === null ? [] : [`cp=${r.attn_cp_rank}`];
    return [`tp=${r.tp_rank}`, `pp=${r.pp_rank}`, `dp=${r.dp_rank}`].concat(cp, quoted(sorted)).join(" ");
  }

  // The warning of a server whose streams reported different worlds, or one larger than the sidecar can
  // hold (world_implausible): which worlds, by how many streams (page.py: world_conflict).
  function worldConflict(doc, server) {
    const counts = new Map();
    for (const s of doc.streams) {
      if (s.server === server.id && s.world !== null) counts.set(worldKey(s.world), (counts.get(worldKey(s.world)) || 0) + 1);
    }
    const worldNames = server.worlds.map(worldName);
    // Two worlds that differ only in the engine's tp size read alike: that size tells them apart.
    const listed = server.worlds.map((w, i) => {
      const alike = worldNames.filter((name) => name === worldNames[i]).length > 1;
      return `${worldNames[i]}${alike ? ` (engine tp ${w.tp_size})` : ""} (${plural(counts.get(worldKey(w)) || 0, "stream")})`;
    }).join(", ");
    const said = server.world_implausible
      ? `report ${listed}, more positions than the ${fmtNumber(doc.sidecar.limits.ranks_allowed)} rank identities ` +
        "this sidecar keeps (ranks.max_ranks)"
      : `report different worlds: ${listed}`;
    return `world conflict: the streams of this server ${said}; no missing rank can be worked out for it`;
  }

  function nodeShare(node) {
    const [tp0, tp1] = node.tp_ranks;
    const [pp0, pp1] = node.pp_ranks;
    return `node ${node.node_rank} of ${node.nodes}: this sidecar expects the ranks at global tp ${tp0}–${tp1 - 1} ` +
      `of pp stages ${pp0}–${pp1 - 1}`;
  }

  // What a dp group's grid leaves out (the sidecar caps it, status.grid_model), with exact counts; "" when nothing.
  function gridCut(g) {
    if (g.rows.length === g.row_count && g.tp_ranks.length === g.column_count) return "";
    return `drawn: ${g.rows.length} of ${g.row_count} rows, ${g.tp_ranks.length} of ${g.column_count} tp columns; ` +
      `${plural(g.hidden_ranks, "rank")} not drawn (their streams are under All streams)`;
  }

  function streamTip(n, s) {
    const pushed = s.seconds_since_push === null ? "never pushed" : `last push ${fmtSeconds(s.seconds_since_push)} ago`;
    return `${streamIdentity(n, s)}\nstate ${s.state}, ${pushed}, restarts ${s.restarts}, ${s.source}`;
  }

  function kindOrder(s) {
    const at = KINDS.indexOf(s.kind);
    return at < 0 ? KINDS.length : at;
  }

  // One rank: its tp rank, its state, a mark when the server's world does not expect it, and a line per
  // stream (kind and state, its identity in the tooltip), as page.py's cell.
  function cell(n, server, rank) {
    const unexpected = server.expected !== null && !rank.expected;
    const where = `dp ${rank.dp_rank} pp ${rank.pp_rank} cp ${rank.attn_cp_rank} tp ${rank.tp_rank} of ${serverName(n, server)}`;
    const said = rank.state === MISSING ? "expected by the server's world, no unexpired stream reports for it"
      : plural(rank.streams.length, "stream");
    const tip = `${where}: ${rank.state}, ${said}` + (unexpected ? "; outside the server's expected world" : "");
    const streams = rank.streams.filter((id) => n.streams.has(id)).map((id) => n.streams.get(id))
      .sort((a, b) => kindOrder(a) - kindOrder(b));
    const children = [text("span", `tp ${rank.tp_rank}`, { class: "tp" }), text("span", rank.state, { class: "st" })];
    if (unexpected) children.push(text("span", UNEXPECTED, { class: "mark" }));
    if (streams.length) {
      children.push(el("span", { class: "streams" }, streams.map((s) =>
        text("span", `${s.kind} ${s.state}`, { class: `stream state-${s.state}`, title: streamTip(n, s) }))));
    }
    return el("td", { class: `rank state-${rank.state}${unexpected ? " unexpected" : ""}`, "data-rank": rank.id, title: tip },
      children);
  }

  // One dp group of a server: pp (× cp) rows by attention tp columns, as page.py's dp_group.
  function dpGroup(n, server, group, at) {
    const g = group.grid;
    const tps = g.tp_ranks;
    const withCp = g.rows.some((row) => row.attn_cp_rank !== 0);
    const head = el("tr", {}, [el("th")].concat(tps.map((tp) => text("th", `tp ${tp}`))));
    const body = el("tbody");
    for (const { pp_rank: pp, attn_cp_rank: cp } of g.rows) {
      const tr = el("tr", {}, [text("th", `pp ${pp}` + (withCp ? ` cp ${cp}` : ""), { scope: "row" })]);
      for (const tp of tps) {
        const rank = at.get(`${pp}/${cp}/${tp}`);
        tr.appendChild(rank ? cell(n, server, rank) : text("td", "–", { class: "rank absent" }));
      }
      body.appendChild(tr);
    }
    const caption = `dp ${group.dp_rank}: ${group.live} of ${plural(group.ranks, "rank")} live` +
      (group.missing ? `, ${group.missing} ${MISSING}` : "") +
      (server.expected !== null && !group.expected ? `; ${UNEXPECTED}` : "");
    const parts = [text("caption", caption), el("thead", {}, [head]), body];
    const cut = gridCut(g);
    if (cut) {
      parts.push(el("tfoot", {}, [el("tr", {}, [text("td", cut, { class: "note grid-cut", colspan: tps.length + 1 })])]));
    }
    return el("table", { class: "grid", "data-server": server.id, "data-dp": group.dp_rank }, parts);
  }

  function serverBlock(doc, n, server, cells) {
    const counts = `${plural(server.ranks, "rank")}, ${plural(server.streams, "stream")}; ${server.live_ranks} live` +
      (server.missing ? `, ${server.missing} ${MISSING}` : "");
    const children = [
      el("h3", {}, [text("span", serverName(n, server), { class: "server-name" }), " · ",
        text("span", serverWorld(server), { class: "world" })]),
      text("p", counts, { class: "note server-counts" }),
    ];
    if (server.world_conflict) children.push(text("p", worldConflict(doc, server), { class: "warning world-conflict" }));
    if (server.node !== null) children.push(text("p", nodeShare(server.node), { class: "note node-share" }));
    children.push(el("div", { class: "groups" },
      server.dp_groups.map((group) => dpGroup(n, server, group, cells.get(group.dp_rank) || new Map()))));
    return el("div", { class: "server", "data-server": server.id }, children);
  }

  // Every server's ranks, one cell per rank listing its streams, a grid per dp group (page.py: grid).
  function grid(doc) {
    if (doc.servers.length === 0) return [text("p", "No rank has connected yet.", { class: "empty" })];
    const n = names(doc);
    const byServer = new Map();  // server id -> dp rank -> "pp/cp/tp" -> rank
    for (const r of doc.ranks) {
      if (!byServer.has(r.server)) byServer.set(r.server, new Map());
      const byDp = byServer.get(r.server);
      if (!byDp.has(r.dp_rank)) byDp.set(r.dp_rank, new Map());
      byDp.get(r.dp_rank).set(`${r.pp_rank}/${r.attn_cp_rank}/${r.tp_rank}`, r);
    }
    return doc.servers.map((server) => serverBlock(doc, n, server, byServer.get(server.id) || new Map()));
  }

  function totals(doc) {
    const rows = doc.transfers.map((t) => row([t.name, `${t.from} → ${t.to}`, fmtNumber(t.tokens), fmtBytes(t.bytes),
      fmtRate(t.bytes_per_second)]));
    return [table(["transfer", "tiers", "tokens", "bytes", "active bandwidth"], rows,
      "no transfer families in the catalog", 5)];
  }

  function sparkline(history, points) {
    const svg = document.createElementNS(SVG, "svg");
    for (const [name, value] of [["class", "spark"], ["width", SPARK_WIDTH], ["height", SPARK_HEIGHT],
      ["viewBox", `0 0 ${SPARK_WIDTH} ${SPARK_HEIGHT}`], ["role", "img"], ["aria-label", "bandwidth history"]]) {
      svg.setAttribute(name, String(value));
    }
    const path = document.createElementNS(SVG, "path");
    path.setAttribute("d", sparklinePath(history, points));
    svg.appendChild(path);
    return svg;
  }

  function bandwidth(doc) {
    const bw = doc.bandwidth;
    const rows = bw.families.map((f) => el("tr", {}, [
      text("td", f.transfer || "–"), text("td", f.family), text("td", fmtRate(f.bytes_per_second)),
      el("td", {}, [sparkline(f.history, bw.history_points)]),
    ]));
    const note = text("p", `Over the last ${fmtSeconds(bw.window_seconds)}; history: one point every ` +
      `${fmtSeconds(bw.history_interval_seconds)}, the last ${bw.history_points}.`, { class: "note" });
    return [note, table(["transfer", "bytes family", "now", "history"], rows, "no bandwidth pairs in the catalog", 4)];
  }

  function reasons(doc) {
    if (doc.reasons.length === 0) return [text("p", "No family with a reason label.", { class: "empty" })];
    const out = [];
    for (const family of doc.reasons) {
      const top = Math.max(0, ...family.by_reason.map((r) => r.value)) || 1;
      const rows = family.by_reason.map((r) => el("tr", {}, [
        text("td", r.reason), text("td", fmtNumber(r.value)),
        el("td", {}, [el("meter", { min: 0, max: top, value: r.value })]),
      ]));
      const note = family.attempt_level ? " (attempt-level: not a final cache-miss count)" : "";
      out.push(text("h3", family.family), text("p", `total ${fmtNumber(family.total)} tokens${note}`, { class: "note" }),
        table(["reason", "tokens", ""], rows, "none yet", 3));
      if (family.other_reasons) {
        out.push(text("p", `and ${fmtNumber(family.other_reasons)} more reasons, ${fmtNumber(family.other_value)} tokens`,
          { class: "note" }));
      }
    }
    return out;
  }

  function spread(doc) {
    const sp = doc.spread;
    const n = names(doc);
    const rows = sp.groups.map((g) => {
      const worst = g.series.length ? g.series[0] : null;
      const where = worst === null ? "–"
        : worst.family + Object.entries(worst.labels).map(([k, v]) => ` ${k}=${v}`).join("");
      return row([`${g.group} ${n.group(n.groups.get(g.group))}`, fmtRatio(g.max_ratio), where, g.diverging ? "diverging" : "agree"], g.diverging ? "diverging" : "");
    });
    const note = text("p", `(max − min) / max of the replicas' increases over the window; above ` +
      `${fmtRatio(sp.threshold)} a group is diverging.`, { class: "note" });
    return [note, table(["group", "max spread", "widest series", ""], rows, "no group has two current replicas", 4)];
  }

  // The state file's line (page.py: state_file).
  function stateFile(p) {
    if (p === null || p === undefined) return "not kept (--persistence.file)";
    let failed = 0;
    for (const n of Object.values(p.write_failures)) failed += n;
    const line = `${p.file}: ${fmtNumber(p.writes)} writes, every ${fmtSeconds(p.interval_seconds)}; ` +
      `${p.loaded_identities} rank identities taken back at start`;
    return line + (failed ? `; ${fmtNumber(failed)} writes failed` : "");
  }

  function health(doc) {
    const s = doc.sidecar;
    const limits = s.limits;
    const byState = Object.entries(s.streams_by_state).map(([state, n]) => `${n} ${state}`).join(", ");
    const t = doc.totals;
    const ranks = `${t.ranks} in ${plural(t.servers, "server")}: ${t.live_ranks} live` +
      (t.missing ? `, ${t.missing} ${MISSING}` : "");
    const items = [
      ["ready", s.ready ? "yes" : "no: the ingest socket is not listening"],
      ["ingest socket", s.ingest.socket_path],
      ["uptime", fmtSeconds(s.uptime_seconds)],
      ["ranks", ranks],
      ["streams", byState],
      ["connections", `${s.connections.open} open of ${s.connections.allowed}, ${s.connections.accepted} accepted`],
      ["snapshots applied", `${fmtNumber(s.snapshots_applied)} of ${fmtNumber(s.snapshots_received)} received`],
      ["samples applied", fmtNumber(s.samples_applied)],
      ["series", `${fmtNumber(limits.series_used)} of ${fmtNumber(limits.series_allowed)} ` +
        `(${fmtNumber(limits.series_rank)} rank, ${fmtNumber(limits.series_rollup)} rollup)`],
      ["rank identities", `${limits.ranks_known} of ${limits.ranks_allowed}`],
      ["stale / expired after", `${fmtSeconds(limits.stale_after_seconds)} / ${fmtSeconds(limits.expire_after_seconds)}`],
      ["state file", stateFile(s.persistence)],
    ];
    const rejected = Object.entries(s.rejections).filter(([, n]) => n > 0)
      .sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
    const right = el("div", {}, [
      text("p", `${fmtNumber(s.rejections_total)} rejected in all`, { class: "note" }),
      table(["rejection reason", "count"], rejected.map(([n, c]) => row([n, fmtNumber(c)])), "no rejections", 2),
    ]);
    const conflicts = Object.entries(s.rollup_layout_conflicts);
    if (conflicts.length) {
      right.appendChild(table(["family left out of its rollup (bucket layout)", "series"],
        conflicts.map(([f, c]) => row([f, c])), "", 2));
    }
    return [el("div", { class: "cols" }, [el("div", {}, [table(["", ""], items.map((i) => row(i)), "", 2)]), right])];
  }

  function streamTable(doc) {
    const n = names(doc);
    const rows = doc.streams.map((r) => row([streamIdentity(n, r), r.kind, r.rank, r.state, r.source, fmtSeconds(r.seconds_since_push),
      r.restarts, r.epoch, r.pid, r.series], `state-${r.state}`));
    return [table(["stream", "kind", "rank", "state", "source", "last push", "restarts", "epoch", "pid", "series"], rows,
      "no streams", 10)];
  }

  // The upstreams, their expected worlds, and a line per way the engine's labels contradict a configured world.
  function upstreams(doc) {
    const rows = doc.upstreams.map((u) => row([u.name, u.source, u.up ? "up" : "down", u.ranks, u.samples,
      u.world === null ? "–" : worldName(u.world),
      u.last_scrape_time === null ? "never" : fmtTime(u.last_scrape_time), u.last_error || ""], u.up ? "up" : "down"));
    const out = [table(["upstream", "source", "status", "ranks", "samples", "world", "last read", "last error"], rows,
      "no upstreams configured", 8)];
    for (const u of doc.upstreams) {
      for (const problem of u.world_problems) out.push(text("p", `${u.name}: ${problem}`, { class: "warning world-problem" }));
    }
    return out;
  }

  // The header line: ranks and streams counted apart, ranks live and missing, streams by state (page.py: summary).
  function summary(doc) {
    const s = doc.sidecar;
    const t = doc.totals;
    const parts = [s.ready ? "ready" : "NOT READY", `${plural(t.ranks, "rank")}, ${plural(t.streams, "stream")}`];
    if (t.ranks || t.missing) parts.push(`ranks: ${t.live_ranks} live` + (t.missing ? `, ${t.missing} ${MISSING}` : ""));
    const states = Object.entries(s.streams_by_state).filter(([, n]) => n > 0).map(([st, n]) => `${n} ${st}`).join(", ");
    if (states) parts.push(`streams: ${states}`);
    parts.push(`up ${fmtSeconds(s.uptime_seconds)}`, `revision ${s.revision.slice(0, 12)}`);
    return parts.join(" · ");
  }

  const SECTIONS = {
    grid: (doc) => [legend(), ...grid(doc)],
    totals, bandwidth, reasons, spread, health, streams: streamTable, upstreams,
  };

  // --- refresh ---

  function render(doc) {
    for (const [name, build] of Object.entries(SECTIONS)) {
      const body = document.getElementById(`${name}-body`);
      if (body) body.replaceChildren(...build(doc));
    }
    document.getElementById("version").textContent = doc.sidecar.version;
    document.getElementById("summary").textContent = summary(doc);
    document.getElementById("updated").textContent = `as of ${fmtTime(doc.generated_at)}`;
  }

  function setState(message, failed) {
    const node = document.getElementById("refresh-state");
    node.textContent = message;
    document.body.classList.toggle("offline", failed);
  }

  const period = Number(document.body.dataset.refreshMs) || 2000;
  let refreshes = 0;

  async function refresh() {
    try {
      // Same origin: the browser sends basic-auth credentials it holds for the page.
      const response = await fetch("api/v1/status", { cache: "no-store", credentials: "same-origin" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      render(await response.json());
      refreshes += 1;
      document.body.dataset.refreshes = String(refreshes);
      setState(`· refreshing every ${period / 1000} s`, false);
    } catch (err) {
      setState(`· update failed (${err.message}); showing the last data, retrying`, true);
    } finally {
      window.setTimeout(refresh, period);
    }
  }

  refresh();
})();
