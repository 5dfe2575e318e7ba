"""What readers show, built from Step records as plain data: coloured text and Plotly figures. No gradio."""
