import { act, actWith, button, bytesUrl, choicePicker, errorView, h, modelPickerView, rerender, setTrait, watch } from "./shared.js";

const SIZES = ["64x64", "128x128", "256x256", "512x512", "768x768", "1024x1024"];

function numberInput(label, key, attrs) {
  return h("input", { type: "number", className: "lk-number", "aria-label": label, "data-key": key, ...attrs });
}

function render({ model, el }) {
  el.classList.add("lk-widget", "lk-image-panel");
  const [picker, pickerView] = modelPickerView(model, "Image model");
  const upscalerPicker = h("span");
  const [banner, bannerView] = errorView(model);
  const status = h("span", { className: "lk-note", role: "status", "aria-live": "polite" });
  const prompt = h("textarea", { className: "lk-image-prompt", rows: "2", "aria-label": "Prompt" });
  const sizes = h("datalist", { id: `lk-sizes-${Math.random().toString(36).slice(2)}` }, SIZES.map((s) => h("option", { value: s })));
  const size = h("input", { className: "lk-size", "aria-label": "Size", placeholder: "model's own", list: sizes.id, size: "10" });
  const steps = numberInput("Steps", "steps", { min: "0", max: "200", placeholder: "model's" });
  const seed = numberInput("Seed", "seed", { min: "-1", placeholder: "random" });
  const count = numberInput("Number of images", "n", { min: "1", max: "10" });
  const grid = h("div", { className: "lk-image-grid", role: "listbox", "aria-label": "Images" });
  const urls = [];

  const save = (name, value) => setTrait(model, name, value);
  const integer = (input, fallback) => (input.value.trim() === "" ? fallback : Math.trunc(Number(input.value)));
  prompt.addEventListener("change", () => save("prompt", prompt.value));
  size.addEventListener("change", () => save("size", size.value.trim()));
  steps.addEventListener("change", () => save("steps", Math.max(0, integer(steps, 0))));
  seed.addEventListener("change", () => save("seed", integer(seed, -1)));
  count.addEventListener("change", () => save("n", Math.min(10, Math.max(1, integer(count, 1)))));

  // what the fields show now, sent with the action (a click may come before a field's change is saved)
  const current = () => ({
    prompt: prompt.value,
    size: size.value.trim(),
    steps: Math.max(0, integer(steps, 0)),
    seed: integer(seed, -1),
    n: Math.min(10, Math.max(1, integer(count, 1))),
  });
  const generate = button("Generate", "Generate images from the prompt", () => {
    if (prompt.value.trim()) actWith(model, current(), "generate", prompt.value);
  });
  const edit = button("Edit", "Edit the picked image with the prompt", () => {
    if (prompt.value.trim()) actWith(model, current(), "edit", prompt.value, model.get("selected"));
  });
  const vary = button("Vary", "Make variations of the picked image", () => {
    actWith(model, current(), "vary", model.get("selected"));
  });
  const upscale = button("Upscale", "Upscale the picked image", () => act(model, "upscale", model.get("selected")));

  el.append(
    h(
      "div",
      { className: "lk-toolbar" },
      picker,
      h("label", { className: "lk-field" }, "Size", size, sizes),
      h("label", { className: "lk-field" }, "Steps", steps),
      h("label", { className: "lk-field" }, "Seed", seed),
      h("label", { className: "lk-field" }, "Images", count),
      button("Refresh", "Refresh the model lists", () => act(model, "refresh_models")),
    ),
    banner,
    prompt,
    h("div", { className: "lk-toolbar" }, generate, edit, vary, upscalerPicker, upscale, status),
    grid,
  );

  // each field shows its own trait only: redrawing the others would drop what is typed in them but not yet saved
  const fields = {
    prompt: [prompt, (v) => v],
    size: [size, (v) => v],
    steps: [steps, (v) => (v ? String(v) : "")],
    seed: [seed, (v) => (v >= 0 ? String(v) : "")],
    n: [count, (v) => String(v)],
  };
  const fieldView = (name) => () => {
    const [input, text] = fields[name];
    const value = text(model.get(name));
    if (input.value !== value) input.value = value;
  };

  const pick = (index) => save("selected", index === model.get("selected") ? -1 : index);

  const views = {
    picker: pickerView,
    upscalers: () =>
      rerender(
        upscalerPicker,
        choicePicker(model.get("upscalers"), model.get("upscaler"), (id) => save("upscaler", id), "Upscaler", "upscaler", "no upscaler"),
      ),
    banner: bannerView,
    grid: () => {
      urls.splice(0).forEach((slot) => slot.url && URL.revokeObjectURL(slot.url));
      const captions = model.get("captions");
      const figures = model.get("images").map((png, index) => {
        const slot = {};
        urls.push(slot);
        const image = h("img", { className: "lk-grid-image", src: bytesUrl(slot, png, "image/png"), alt: `Image ${index + 1}: ${captions[index] || ""}` });
        return h(
          "figure",
          {
            className: "lk-image",
            role: "option",
            tabindex: "0",
            "data-index": String(index),
            onclick: () => pick(index),
            onkeydown: (e) => {
              if (e.key === "Enter" || e.key === " ") {
                e.preventDefault();
                pick(index);
              }
            },
          },
          image,
          h("figcaption", {}, captions[index] || ""),
        );
      });
      grid.replaceChildren(...figures);
      el.dataset.images = String(figures.length);
      views.selection();
    },
    selection: () => {
      const selected = model.get("selected");
      grid.querySelectorAll(".lk-image").forEach((figure) => {
        const on = Number(figure.dataset.index) === selected;
        figure.classList.toggle("lk-selected", on);
        figure.setAttribute("aria-selected", String(on));
      });
      el.dataset.selected = String(selected);
      views.status();
    },
    status: () => {
      const busy = model.get("busy");
      const picked = model.get("selected") >= 0 && model.get("selected") < model.get("images").length;
      el.dataset.busy = String(busy);
      generate.disabled = busy;
      edit.disabled = vary.disabled = busy || !picked;
      upscale.disabled = busy || !picked || !model.get("upscaler");
      status.textContent = busy ? `${model.get("activity") || "Working"}…` : "";
    },
  };
  const unwatch = watch(model, {
    models: views.picker,
    model: views.picker,
    upscalers: views.upscalers,
    upscaler: [views.upscalers, views.status],
    error: views.banner,
    ...Object.fromEntries(Object.keys(fields).map((name) => [name, fieldView(name)])),
    images: views.grid,
    captions: views.grid,
    selected: views.selection,
    busy: views.status,
    activity: views.status,
  });
  return () => {
    unwatch();
    urls.forEach((slot) => slot.url && URL.revokeObjectURL(slot.url));
  };
}

export default { render };
