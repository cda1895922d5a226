// ESLint for the example: the recommended rules on its JavaScript (types are checked by tsc --checkJs).
import js from "@eslint/js";
import globals from "globals";

export default [
  { ignores: ["node_modules/"] },
  js.configs.recommended,
  { languageOptions: { globals: { ...globals.node } } },
];
