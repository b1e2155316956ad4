// Building blocks every lemonkit panel uses (the Python side inlines this file into each panel's module).

export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "className") node.className = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined && child !== false) node.append(child);
  }
  return node;
}

// JS asks, Python does the work: the browser never talks to the server itself.
export function act(model, action, ...args) {
  model.send({ action, args });
}

// ipywidgets holds a model update back while an earlier one is unanswered, but sends custom messages at once: an
// action that depends on fields the page just edited carries their values (the panel's ``page_fields``)
export function actWith(model, state, action, ...args) {
  model.send({ action, args, state });
}

// Set a synced trait from the page and send it to the kernel.
export function setTrait(model, name, value) {
  model.set(name, value);
  model.save_changes();
}

// Run each view whenever one of its traits changes (triggers: trait name -> a view, or a list of views), and every
// view once now; returns what stops it (a panel's cleanup).
export function watch(model, triggers) {
  const bound = Object.entries(triggers).flatMap(([name, views]) => [views].flat().map((view) => [name, view]));
  for (const [name, view] of bound) model.on(`change:${name}`, view);
  new Set(bound.map(([, view]) => view)).forEach((view) => view());
  return () => bound.forEach(([name, view]) => model.off(`change:${name}`, view));
}

export function formatBytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KB", "MB", "GB", "TB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log(n) / Math.log(1024)));
  return `${(n / 1024 ** i).toFixed(i ? 1 : 0)} ${units[i]}`;
}

// Replace a container's content, keeping keyboard focus on the element with the same data-key.
export function rerender(container, ...children) {
  const focused = document.activeElement;
  const key = focused && container.contains(focused) ? focused.dataset.key : undefined;
  container.replaceChildren(...children.flat().filter((c) => c));
  if (key) container.querySelector(`[data-key="${CSS.escape(key)}"]`)?.focus();
}

// A download's progress: {status, percent, done, total, file, error}.
export function progressBar(state, label) {
  const percent = Math.max(0, Math.min(100, Math.round(state.percent || 0)));
  const detail = state.total ? `${formatBytes(state.done)} / ${formatBytes(state.total)}` : "";
  const text = [state.status, `${percent}%`, detail, state.file].filter((s) => s).join(" · ");
  return h(
    "div",
    { className: `lk-progress lk-status-${state.status || "idle"}`, "data-status": state.status || "" },
    h(
      "div",
      {
        className: "lk-progress-track",
        role: "progressbar",
        "aria-label": label,
        "aria-valuemin": "0",
        "aria-valuemax": "100",
        "aria-valuenow": String(percent),
      },
      h("div", { className: "lk-progress-fill", style: `width: ${percent}%` }),
    ),
    h("span", { className: "lk-progress-text" }, text),
  );
}

// An error {message, code}; onDismiss (optional) adds a close button.
export function errorBanner(error, onDismiss, key = "dismiss-error") {
  if (!error) return null;
  return h(
    "div",
    { className: "lk-error", role: "alert" },
    h("span", { className: "lk-error-text" }, error.code ? `${error.message} (${error.code})` : error.message),
    onDismiss
      ? h("button", { className: "lk-button", "aria-label": "Dismiss error", "data-key": key, onclick: onDismiss }, "×")
      : null,
  );
}

// A <select> over string choices; onChange gets the chosen one.
export function choicePicker(choices, selected, onChange, label, key, empty) {
  return h(
    "select",
    { className: "lk-picker", "aria-label": label, "data-key": key, onchange: (e) => onChange(e.target.value) },
    choices.length ? null : h("option", { value: "" }, empty),
    choices.map((id) => h("option", { value: id, selected: id === selected }, id)),
  );
}

// A <select> over model ids; onChange gets the chosen id.
export function modelPicker(models, selected, onChange, label = "Model") {
  return choicePicker(models, selected, onChange, label, "model-picker", "no model available");
}

// A task panel's model picker (its models and model traits) and the view that redraws it: [node, view].
export function modelPickerView(model, label) {
  const node = h("span");
  const pick = (id) => setTrait(model, "model", id);
  return [node, () => rerender(node, modelPicker(model.get("models"), model.get("model"), pick, label))];
}

// A panel's error banner (its error trait; the close button dismisses it) and the view that redraws it: [node, view].
export function errorView(model) {
  const node = h("div", { className: "lk-banner" });
  return [node, () => rerender(node, errorBanner(model.get("error"), () => act(model, "dismiss")))];
}

// An object URL for the bytes of a Bytes traitlet (a DataView), "" for none; the URL slot.url held before is revoked.
export function bytesUrl(slot, bytes, type) {
  if (slot.url) URL.revokeObjectURL(slot.url);
  slot.url = bytes && bytes.byteLength ? URL.createObjectURL(new Blob([bytes], type ? { type } : {})) : "";
  return slot.url;
}

// Point node's attribute (src by default) at url and show it; with no url, drop the attribute and hide the node.
export function showUrl(node, url, attribute = "src") {
  if (url) node.setAttribute(attribute, url);
  else node.removeAttribute(attribute);
  node.hidden = !url;
}

// An audio player; data-ready says whether its current source can be played (and seeked).
export function audioPlayer(label) {
  const player = h("audio", { controls: true, preload: "auto", className: "lk-player", "aria-label": label });
  player.dataset.ready = "false";
  player.addEventListener("loadedmetadata", () => (player.dataset.ready = "true"));
  player.addEventListener("emptied", () => (player.dataset.ready = "false"));
  return player;
}

// Show an error raised in the page (no kernel round trip) in the panel's banner.
export function pageError(model, message, code = "browser_error") {
  setTrait(model, "error", { message, code });
}

export function button(text, label, onclick, extra = {}) {
  return h("button", { className: "lk-button", "aria-label": label, onclick, ...extra }, text);
}
