// The status page's refresh: fetches api/v1/status every few seconds and rebuilds each section
// with the same structure as exporter/sidecar/expose/page.py renders on the server. Values only ever go
// in through textContent and setAttribute, never parsed as markup, so a label value is always text.
"use strict";

(function () {
  const STATES = ["live", "stale", "departed", "expired"];
  const MISSING = "missing";  // a position or dp group the ranks' world expects and no known rank holds
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

  function fmtWorld(w) {
    return `tp ${w.tp_size} × pp ${w.pp_size} × dp ${w.dp_size}`;
  }

  function labelText(labels) {
    return Object.entries(labels).map(([k, v]) => `${k}=${v}`).join(" ") || "no static labels";
  }

  // What the document writes once and references by id, read back as text (page.py's Names).
  function quoted(labels) {  // name="value", backslash, quote and newline escaped, as /metrics writes them
    return Object.entries(labels).map(([k, v]) =>
      `${k}="${v.replace(/\\/g, "\\\\").replace(/"/g, '\\"').replace(/\n/g, "\\n")}"`);
  }

  function names(doc) {
    const labels = new Map(doc.label_sets.map((s) => [s.id, s.labels]));
    const groups = new Map(doc.groups.map((g) => [g.id, g]));
    return {
      labels, groups,
      group: (g) => [`dp=${g.dp_rank}`].concat(quoted(labels.get(g.label_set))).join(" "),
      rank: (r) => {
        const all = Object.assign({}, labels.get(groups.get(r.group).label_set), r.own_labels);
        const sorted = Object.fromEntries(Object.keys(all).sort().map((k) => [k, all[k]]));
        const cp = r.attn_cp_rank === null ? [] : [`cp=${r.attn_cp_rank}`];
        return [`tp=${r.tp_rank}`, `pp=${r.pp_rank}`, `dp=${r.dp_rank}`].concat(cp, quoted(sorted)).join(" ");
      },
    };
  }

  // One warning per label set whose ranks reported different worlds, or a world larger than the sidecar
  // can hold (world_implausible): which worlds, by how many ranks. One pass over the ranks.
  function worldConflicts(doc) {
    const n = names(doc);
    const conflicting = new Map();  // label set -> whether its one world is implausible
    for (const group of doc.groups) {
      if (group.world_conflict) conflicting.set(group.label_set, group.world_implausible);
    }
    const counts = new Map(Array.from(conflicting.keys(), (key) => [key, new Map()]));
    for (const r of doc.ranks) {
      const key = n.groups.get(r.group).label_set;
      if (r.world !== null && counts.has(key)) {
        const byWorld = counts.get(key);
        byWorld.set(fmtWorld(r.world), (byWorld.get(fmtWorld(r.world)) || 0) + 1);
      }
    }
    const allowed = doc.sidecar.limits.ranks_allowed;
    const lines = [];
    for (const [key, implausible] of conflicting) {
      const worlds = Array.from(counts.get(key), ([w, c]) => `${w} (${c} rank${c === 1 ? "" : "s"})`).join(", ");
      const said = implausible
        ? `report ${worlds}, more positions than the ${fmtNumber(allowed)} rank identities this sidecar keeps ` +
          "(ranks.max_ranks)"
        : `report different parallel sizes: ${worlds}`;
      lines.push(`world conflict: the ranks with ${labelText(n.labels.get(key))} ${said}; ` +
        "no missing rank can be worked out for them");
    }
    return lines;
  }

  // What a group's grid leaves out (the sidecar caps it, status.grid_model), with exact counts; "" when nothing.
  function gridCut(group) {
    const g = group.grid;
    if (g.rows.length === g.row_count && g.tp_ranks.length === g.column_count) return "";
    return `drawn: ${g.rows.length} of ${g.row_count} rows, ${g.tp_ranks.length} of ${g.column_count} tp columns; ` +
      `${g.hidden_ranks} rank${g.hidden_ranks === 1 ? "" : "s"} not drawn (all are under All ranks)`;
  }

  // The group's `grid` as the sidecar bounded it: pp (× cp) rows by tp columns, as page.py draws it.
  function grid(doc) {
    if (doc.groups.length === 0) return [text("p", "No rank has connected yet.", { class: "empty" })];
    const n = names(doc);
    const members = new Map();
    for (const r of doc.ranks) {
      if (!members.has(r.group)) members.set(r.group, []);
      members.get(r.group).push(r);
    }
    const out = worldConflicts(doc).map((line) => text("p", line, { class: "warning world-conflict" }));
    const groups = el("div", { class: "groups" });
    for (const group of doc.groups) {
      const name = n.group(group);
      const own = members.get(group.id) || [];
      const at = new Map();
      for (const r of own) at.set(`${r.pp_rank}/${r.attn_cp_rank}/${r.tp_rank}`, r);
      const missing = new Set(group.missing.map((m) => `${m.pp_rank}/${m.tp_rank}`));
      const tps = group.grid.tp_ranks;
      const span = new Map();  // a pp stage's rows drawn: what its missing cells span
      for (const row of group.grid.rows) span.set(row.pp_rank, (span.get(row.pp_rank) || 0) + 1);
      const head = el("tr", {}, [el("th")].concat(tps.map((tp) => text("th", `tp ${tp}`))));
      const body = el("tbody");
      const started = new Set();
      for (const { pp_rank: pp, attn_cp_rank: cp } of group.grid.rows) {
        const first = !started.has(pp);  // the later rows of a stage are under its missing cells' rowspan
        started.add(pp);
        const tr = el("tr", {}, [text("th", `pp ${pp}` + (cp === null ? "" : ` cp ${cp}`), { scope: "row" })]);
        for (const tp of tps) {
          if (missing.has(`${pp}/${tp}`)) {
            if (first) {
              tr.appendChild(el("td", {
                class: `rank state-${MISSING}`, rowspan: span.get(pp) > 1 ? span.get(pp) : null,
                "data-missing": `${pp}/${tp}`,
                title: `pp ${pp} tp ${tp} of ${name}: expected by the ranks' world, no known rank holds it`,
              }, [text("span", `tp ${tp}`, { class: "tp" }), text("span", MISSING, { class: "st" })]));
            }
            continue;
          }
          const r = at.get(`${pp}/${cp}/${tp}`);
          if (!r) {
            tr.appendChild(text("td", "–", { class: "rank absent" }));
            continue;
          }
          const tip = `${n.rank(r)}\nstate ${r.state}, last push ${fmtSeconds(r.seconds_since_push)} ago, ` +
            `restarts ${r.restarts}, ${r.source}`;
          tr.appendChild(el("td", { class: `rank state-${r.state}`, "data-rank": r.id, title: tip }, [
            text("span", `tp ${tp}`, { class: "tp" }), text("span", r.state, { class: "st" }),
          ]));
        }
        body.appendChild(tr);
      }
      const caption = `${group.id} ${name}: ${group.live} of ${group.size} live` +
        (group.missing_count ? `, ${group.missing_count} ${MISSING}` : "");
      const parts = [text("caption", caption), el("thead", {}, [head]), body];
      const cut = gridCut(group);
      if (cut) {
        parts.push(el("tfoot", {}, [el("tr", {}, [text("td", cut, { class: "note grid-cut", colspan: tps.length + 1 })])]));
      }
      groups.appendChild(el("table", { class: "grid", "data-group": group.id }, parts));
    }
    for (const absent of doc.missing_groups) {
      const e = absent.expected;
      const note = `${MISSING}: no rank of this dp group has reported (expected tp ${e.tp_size} × pp ${e.pp_size})`;
      const name = n.group(absent);
      groups.appendChild(el("table", { class: "grid missing-group", "data-missing-group": name }, [
        text("caption", `${name}: ${MISSING}`),
        el("tbody", {}, [el("tr", {}, [text("td", note, { class: `rank state-${MISSING}` })])]),
      ]));
    }
    out.push(groups);
    const more = doc.missing_totals.groups - doc.missing_groups.length;
    if (more > 0) out.push(text("p", `and ${more} more missing dp groups`, { class: "note" }));
    return out;
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
    const byState = Object.entries(s.ranks_by_state).map(([state, n]) => `${n} ${state}`).join(", ");
    const items = [
      ["ready", s.ready ? "yes" : "no: the ingest socket is not listening"],
      ["ingest socket", s.ingest.socket_path],
      ["uptime", fmtSeconds(s.uptime_seconds)],
      ["ranks", byState],
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

  function rankTable(doc) {
    const n = names(doc);
    const rows = doc.ranks.map((r) => row([n.rank(r), r.group, r.state, r.source, fmtSeconds(r.seconds_since_push), r.restarts,
      r.epoch, r.pid, r.series], `state-${r.state}`));
    return [table(["rank", "group", "state", "source", "last push", "restarts", "epoch", "pid", "series"], rows,
      "no ranks", 9)];
  }

  function upstreams(doc) {
    const rows = doc.upstreams.map((u) => row([u.name, u.source, u.up ? "up" : "down", u.ranks, u.samples,
      u.last_scrape_time === null ? "never" : fmtTime(u.last_scrape_time), u.last_error || ""], u.up ? "up" : "down"));
    return [table(["upstream", "source", "status", "ranks", "samples", "last read", "last error"], rows,
      "no upstreams configured", 7)];
  }

  function summary(doc) {
    const s = doc.sidecar;
    let states = Object.entries(s.ranks_by_state).filter(([, n]) => n > 0).map(([st, n]) => `${n} ${st}`).join(", ");
    states = states || "no ranks";
    if (doc.missing_totals.positions) states += `, ${doc.missing_totals.positions} ${MISSING}`;
    return `${s.ready ? "ready" : "NOT READY"} · ${states} · up ${fmtSeconds(s.uptime_seconds)} · ` +
      `revision ${s.revision.slice(0, 12)}`;
  }

  const SECTIONS = {
    grid: (doc) => [legend(), ...grid(doc)],
    totals, bandwidth, reasons, spread, health, ranks: rankTable, upstreams,
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
