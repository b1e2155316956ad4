import { act, button, errorBanner, h, progressBar, rerender, watch } from "./shared.js";

function render({ model, el }) {
  el.classList.add("lk-widget", "lk-download-bar");
  const update = () => {
    const state = model.get("progress");
    const name = model.get("model_name");
    const active = model.get("controls") && ["starting", "downloading"].includes(state.status);
    rerender(
      el,
      h("span", { className: "lk-name" }, name),
      progressBar(state, `Download of ${name}`),
      active ? button("Pause", `Pause download of ${name}`, () => act(model, "pause"), { "data-key": "pause" }) : null,
      active ? button("Cancel", `Cancel download of ${name}`, () => act(model, "cancel"), { "data-key": "cancel" }) : null,
      errorBanner(model.get("error")),
    );
  };
  return watch(model, Object.fromEntries(["progress", "error", "controls", "model_name"].map((name) => [name, update])));
}

export default { render };
