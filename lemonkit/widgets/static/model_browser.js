import { act, button, errorBanner, errorView, h, progressBar, rerender, setTrait, watch } from "./shared.js";

const ACTIVE = new Set(["starting", "downloading"]);

function matches(row, query, label) {
  const q = query.trim().toLowerCase();
  const text = `${row.id} ${row.labels.join(" ")} ${row.recipe || ""}`.toLowerCase();
  return (!q || text.includes(q)) && (!label || row.labels.includes(label));
}

function stateText(row) {
  if (row.supported === false) return `unsupported: ${row.unsupported_reason || "not on this machine"}`;
  if (row.loaded) return "loaded";
  return row.downloaded ? "downloaded" : "not downloaded";
}

function rowActions(model, row, job, pending) {
  const disabled = Boolean(pending);
  const key = (action) => ({ "data-key": `${action}:${row.id}`, disabled });
  const actions = [];
  if (job && ACTIVE.has(job.status)) {
    actions.push(button("Pause", `Pause download of ${row.id}`, () => act(model, "pause", row.id), key("pause")));
    actions.push(button("Cancel", `Cancel download of ${row.id}`, () => act(model, "cancel", row.id), key("cancel")));
  } else if (!row.downloaded && row.supported !== false) {
    const resume = job && job.status === "paused";
    actions.push(
      button(resume ? "Resume" : "Pull", `${resume ? "Resume" : "Pull"} ${row.id}`, () => act(model, "pull", row.id), key("pull")),
    );
  }
  if (row.downloaded && row.supported !== false) {
    actions.push(
      row.loaded
        ? button("Unload", `Unload ${row.id}`, () => act(model, "unload", row.id), key("unload"))
        : button("Load", `Load ${row.id}`, () => act(model, "load", row.id), key("load")),
    );
  }
  if (row.downloaded && row.deletable) {
    actions.push(button("Delete", `Delete ${row.id}`, () => act(model, "delete", row.id), key("delete")));
  }
  if (pending) actions.push(h("span", { className: "lk-pending", "aria-live": "polite" }, `${pending}…`));
  return actions;
}

function tableRow(model, row) {
  const job = model.get("downloads")[row.id];
  const pending = model.get("pending")[row.id];
  const error = model.get("row_errors")[row.id];
  return h(
    "tr",
    { "data-model": row.id, "data-state": stateText(row) },
    h("td", { className: "lk-name" }, row.id),
    h("td", {}, row.labels.map((label) => h("span", { className: "lk-label" }, label))),
    h("td", { className: "lk-size" }, row.size ? `${row.size} GB` : ""),
    h(
      "td",
      { className: "lk-state" },
      stateText(row),
      job ? progressBar(job, `Download of ${row.id}`) : null,
      errorBanner(error, () => act(model, "dismiss", row.id), `dismiss:${row.id}`),
    ),
    h("td", { className: "lk-actions" }, rowActions(model, row, job, pending)),
  );
}

function render({ model, el }) {
  const search = h("input", {
    type: "search",
    className: "lk-search",
    placeholder: "Search models",
    "aria-label": "Search models",
    value: model.get("query"),
    oninput: (e) => setTrait(model, "query", e.target.value),
  });
  const labelFilter = h("select", {
    className: "lk-label-filter",
    "aria-label": "Filter by label",
    onchange: (e) => setTrait(model, "label", e.target.value),
  });
  const [banner, bannerView] = errorView(model);
  const body = h("tbody");
  const count = h("span", { className: "lk-count", "aria-live": "polite" });
  const table = h(
    "table",
    { className: "lk-table", "aria-label": "Models" },
    h("thead", {}, h("tr", {}, ["Model", "Labels", "Size", "State", "Actions"].map((t) => h("th", { scope: "col" }, t)))),
    body,
  );
  el.classList.add("lk-widget", "lk-model-browser");
  el.append(
    h(
      "div",
      { className: "lk-toolbar" },
      search,
      labelFilter,
      button("Refresh", "Refresh the model list", () => act(model, "refresh"), { "data-key": "refresh" }),
      count,
    ),
    banner,
    table,
  );

  const update = () => {
    const rows = model.get("rows");
    const labels = [...new Set(rows.flatMap((r) => r.labels))].sort();
    const chosen = model.get("label");
    if (document.activeElement !== search) search.value = model.get("query");
    rerender(
      labelFilter,
      h("option", { value: "" }, "all labels"),
      labels.map((l) => h("option", { value: l, selected: l === chosen }, l)),
    );
    const visible = rows.filter((r) => matches(r, model.get("query"), chosen));
    count.textContent = `${visible.length} of ${rows.length} models`;
    bannerView();
    rerender(body, visible.map((row) => tableRow(model, row)));
  };
  const names = ["rows", "downloads", "pending", "row_errors", "error", "query", "label"];
  return watch(model, Object.fromEntries(names.map((name) => [name, update])));
}

export default { render };
