// The status page's refresh: every few seconds it fetches the page again and swaps in the sections the
// server rendered (exporter/sidecar/expose/page.py, the page's one renderer), so it draws nothing of its
// own and cannot drift from the server. The fetched page is parsed into an inert document (no script
// runs in it, nothing loads) and its nodes are moved across; every value in them the server escaped.
"use strict";

(function () {
  const HEADER = ["version", "summary", "updated"];  // the header's parts that change with the document
  const period = Number(document.body.dataset.refreshMs) || 2000;
  let refreshes = 0;

  // Each section body and header part of the fresh page replaces the one shown, by id.
  function swap(fresh) {
    const ids = Array.from(document.querySelectorAll("main .body"), (body) => body.id).concat(HEADER);
    for (const id of ids) {
      const shown = document.getElementById(id);
      const next = fresh.getElementById(id);
      // Copied out first: adopting a node takes it out of the live childNodes list.
      if (shown && next) shown.replaceChildren(...Array.from(next.childNodes).map((node) => document.adoptNode(node)));
    }
  }

  function setState(message, failed) {
    const node = document.getElementById("refresh-state");
    node.textContent = message;
    document.body.classList.toggle("offline", failed);
  }

  async function refresh() {
    try {
      // Same origin: the browser sends basic-auth credentials it holds for the page.
      const response = await fetch(window.location.pathname, { cache: "no-store", credentials: "same-origin" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      swap(new DOMParser().parseFromString(await response.text(), "text/html"));
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
